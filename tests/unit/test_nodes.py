"""workflows.nodes without Slurm: the builtin node-list parser, the launch environment, the CLI.

NODELIST_CASES is what `scontrol show hostnames` (Slurm 22.05) prints for each list, None where it
rejects the list; tests/slurm/test_cluster_hostnames.py checks every case against the real scontrol.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from workflows import nodes, slurm
from workflows.netinfo import NodeAddress
from workflows.nodes import InvalidNodeList, expand_builtin, launch_environment, master_port

NODELIST_CASES: list[tuple[str, list[str] | None]] = [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-10]", [f"node{i:02d}" for i in range(1, 11)]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("n[01-2]", ["n01", "n02"]),  # the width comes from the low end...
    ("n[1-02]", ["n1", "n2"]),  # ...only
    ("n[007-9]", ["n007", "n008", "n009"]),
    ("n[1,3-5]", ["n1", "n3", "n4", "n5"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),  # order kept, never sorted
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("x[1-3]y[5]", ["x1y5", "x2y5", "x3y5"]),
    # Three groups: Slurm varies the middle group slowest (hostlist.c's recursion order).
    ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("n[1-2],m[3]", ["n1", "n2", "m3"]),
    ("a,b,a", ["a", "b", "a"]),  # duplicates kept
    ("n[1-2],n[2-3]", ["n1", "n2", "n2", "n3"]),
    ("n[1,1]", ["n1", "n1"]),
    ("a b\tc", ["a", "b", "c"]),  # space and tab separate like commas
    (",n,,m,", ["n", "m"]),
    ("", []),
    ("host-1.domain", ["host-1.domain"]),
    ("n]x[1-2]", ["n]x1", "n]x2"]),
    ("n[1-", ["n]"]),  # an unmatched '[' is taken literally, with a ']' appended
    ("n[1-]", ["n1"]),
    ("n[1, 2]", ["n1", "n02"]),  # " 2" is two characters wide
    ("n99999999999999999999999", ["n00018446744073709551615"]),  # strtoul saturates
    # rejected
    ("n[5-3]", None),
    ("n[a-b]", None),
    ("n[]", None),
    ("n[1,]", None),
    ("n[-1]", None),
    ("n[1--2]", None),
    ("n[1-2].dom", None),  # nothing may follow the last bracket group
    ("n[1-2]x[3-4]y", None),
    ("n[[1]]", None),
    ("n[1x2]", None),
    ("n[0-65536]", None),  # more than 64K hosts in one range
    ("a[0-40000,0-40000]b[1]", None),  # an earlier group expanding to more than 64K names
    ("a[1-2]b[1]c[x]", None),
    ("a[x]b[1]c[1]", None),  # reported deep in the recursion: scontrol prints an error and no host
]


@pytest.mark.parametrize(("nodelist", "expected"), NODELIST_CASES, ids=[repr(c[0]) for c in NODELIST_CASES])
def test_builtin_parser_matches_scontrol_table(nodelist, expected):
    if expected is None:
        with pytest.raises(InvalidNodeList) as caught:
            expand_builtin(nodelist)
        assert str(caught.value).startswith(f"invalid node list {nodelist!r}: ")
    else:
        assert expand_builtin(nodelist) == expected


def test_large_ranges_at_slurms_limits():
    assert len(expand_builtin("n[0-65535]")) == 65536
    assert len(expand_builtin("a[0-30000,0-30000]b[1]")) == 60002
    # Past the limit one level down, Slurm silently keeps what it expanded so far.
    assert len(expand_builtin("a[0-40000,0-40000]b[1]c[1]")) == 40001


@pytest.mark.parametrize(("nodelist", "reason"), [
    ("n[5-3]", "invalid range `5-3' (descending)"),
    ("n[1-2].dom", "'.dom' follows the last ']'"),
    ("n[0-65536]", "too many hosts in range `0-65536'"),
    ("n[1--2]", "negative numbers are not allowed"),
])
def test_rejections_say_why(nodelist, reason):
    with pytest.raises(InvalidNodeList, match=r"^invalid node list") as caught:
        expand_builtin(nodelist)
    assert reason in caught.value.reason


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="parser='fancy': must be one of auto, builtin, scontrol"):
        nodes.expand_nodelist("n1", parser="fancy")


def test_auto_uses_the_builtin_parser_without_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no scontrol anywhere
    assert nodes.expand_nodelist("gpu[1-2]") == ["gpu1", "gpu2"]


def test_a_missing_slurm_conf_falls_back_at_once(monkeypatch, tmp_path):
    # scontrol itself would retry for a minute; the check before it answers at once.
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    with pytest.raises(slurm.SlurmError, match=r"missing.conf does not exist"):
        nodes.expand_scontrol("n[1-2]")
    assert nodes.expand_nodelist("n[1-2]") == ["n1", "n2"]


def test_master_port_follows_the_job_id():
    assert master_port(0) == 20000
    assert master_port(1234) == 21234
    assert master_port(123456) == 23456
    with pytest.raises(ValueError, match="job_id=-1"):
        master_port(-1)


def _ib(node, address, netdev="ib0", hcas=("mlx5_0",)):
    return NodeAddress(node, address, "infiniband", netdev, hcas)


def test_launch_environment_keeps_node_order_and_sets_nccl_for_infiniband():
    env = launch_environment([_ib("b", "10.0.0.2"), _ib("a", "10.0.0.1", hcas=("mlx5_0", "mlx5_1"))], 42)
    assert env == {
        "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "20042", "NODE_IPS": "10.0.0.2,10.0.0.1",
        "NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    }


def test_launch_environment_without_infiniband_sets_no_nccl_variables():
    mixed = [_ib("a", "10.0.0.1"), NodeAddress("b", "192.168.1.2", "slurm")]
    env = launch_environment(mixed, 7)
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "20007", "NODE_IPS": "10.0.0.1,192.168.1.2"}
    with pytest.raises(ValueError, match="no nodes"):
        launch_environment([], 7)


def test_node_address_validation_names_every_bad_field():
    with pytest.raises(ValueError) as caught:
        NodeAddress("", "10.0.0.300", "carrier-pigeon")
    message = str(caught.value)
    assert "node=''" in message and "address='10.0.0.300'" in message and "source='carrier-pigeon'" in message
    address = NodeAddress("n1", "10.1.2.3", "roce", "eth2", ("mlx5_1",))
    assert NodeAddress.from_json(address.to_json()) == address


def test_cli_prints_one_host_per_line(capsys):
    assert nodes.main(["hostnames", "rack[1-2]-n[1-2]", "--parser", "builtin"]) == 0
    assert capsys.readouterr().out == "rack1-n1\nrack1-n2\nrack2-n1\nrack2-n2\n"


def test_cli_rejects_an_invalid_list_with_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "workflows.nodes", "hostnames", "n[5-3]", "--parser", "builtin"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == "workflows.nodes: invalid node list 'n[5-3]': invalid range `5-3' (descending)\n"


def test_env_outside_a_job_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert nodes.main(["env"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "workflows.nodes: SLURM_JOB_NODELIST is unset: run inside a Slurm job or pass --nodelist"]


def test_env_without_probe_resolves_names_and_prints_exports(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_CONF", raising=False)  # no cluster to ask: DNS answers
    assert nodes.main(["env", "--nodelist", "localhost", "--job-id", "31", "--no-probe"]) == 0
    assert capsys.readouterr().out == (
        "export MASTER_ADDR=127.0.0.1\nexport MASTER_PORT=20031\nexport NODE_IPS=127.0.0.1\n")


def test_main_called_in_process_leaves_the_signal_dispositions_alone():
    # The probe ignores USR1 only when run as a program: an ignored signal is inherited by later
    # child processes (a bash started so can never trap it; this broke the sbatch signal tests).
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    nodes.main(["hostnames", "rack[1-2]-n[1-2]", "--parser", "builtin"])
    assert signal.getsignal(signal.SIGUSR1) == before


def test_env_from_the_nodes_reports_probes_nothing(monkeypatch, capsys, tmp_path):
    # What the training file does inside IMAGE: the nodes' `address` lines in, the exports out.
    monkeypatch.setattr(nodes, "_probe_with_srun", lambda *a: pytest.fail("env --addresses must not srun"))
    reports = tmp_path / "reports"
    reports.write_text("workflows.nodes[n2]: INFO: a log line\n"
                       + _ib("n2", "10.0.0.2").to_json() + "\n" + _ib("n1", "10.0.0.1").to_json() + "\n")
    assert nodes.main(["env", "--nodelist", "n[1-2]", "--job-id", "5", "--addresses", str(reports)]) == 0
    assert capsys.readouterr().out == (
        "export MASTER_ADDR=10.0.0.1\nexport MASTER_PORT=20005\nexport NODE_IPS=10.0.0.1,10.0.0.2\n"
        "export NCCL_SOCKET_IFNAME=ib0\nexport NCCL_IB_HCA=mlx5_0\n")


def test_env_falls_back_to_the_handed_in_node_addr_for_a_node_that_did_not_report(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("MDPP_NODE_ADDRS", "n1=127.0.0.11,n2=127.0.0.12")
    reports = tmp_path / "reports"
    reports.write_text(NodeAddress("n1", "127.0.0.11", "slurm").to_json() + "\n")
    assert nodes.main(["env", "--nodelist", "n[1-2]", "--job-id", "5", "--addresses", str(reports)]) == 0
    assert "export NODE_IPS=127.0.0.11,127.0.0.12\n" in capsys.readouterr().out


def test_env_names_an_unreadable_reports_file(capsys, tmp_path):
    assert nodes.main(["env", "--nodelist", "n1", "--job-id", "5", "--addresses", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith(f"workflows.nodes: --addresses {tmp_path / 'nope'}: No such file")
