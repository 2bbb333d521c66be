"""workflows.nodes against the real Slurm: node-list expansion equals `scontrol show hostnames`
(the table, plus seeded random lists), and `python -m workflows.nodes env` inside a two-node job
prints the nodes' Slurm addresses."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from tests.slurm.conftest import REPO
from tests.unit.test_nodes import NODELIST_CASES
from workflows.nodes import InvalidNodeList, expand_builtin, expand_scontrol, master_port


def _outcome(expand, nodelist):
    try:
        return expand(nodelist)
    except InvalidNodeList:
        return None


@pytest.mark.timeout(120)
def test_table_matches_scontrol_show_hostnames():
    assert len(NODELIST_CASES) >= 20 and sum(e is None for _, e in NODELIST_CASES) >= 10
    mismatches = []
    for nodelist, expected in NODELIST_CASES:
        real = _outcome(expand_scontrol, nodelist)
        ours = _outcome(expand_builtin, nodelist)
        if not (real == ours == expected):
            mismatches.append(f"{nodelist!r}: scontrol {real}, builtin {ours}, table {expected}")
    assert not mismatches, "\n".join(mismatches)


def _random_lists(seed: int, count: int) -> list[str]:
    """Lists built from the pieces Slurm's parser cares about: brackets, ranges, odd numbers."""
    rng = random.Random(seed)
    numbers = ["0", "1", "2", "9", "10", "01", "007", "+1", " 2", "1a", "", "x", "-1"]

    def group():
        items = [rng.choice(numbers) + (f"-{rng.choice(numbers)}" if rng.random() < 0.5 else "")
                 for _ in range(rng.randint(1, 3))]
        return "[" + ",".join(items) + rng.choice(["]", "]", "]", "", "]]"])

    def name():
        return "".join(rng.choice(["n", "rack", "-", ".", "a]", ""]) + (group() if rng.random() < 0.7 else "")
                       for _ in range(rng.randint(1, 3)))

    return [rng.choice([",", " ", ",,"]).join(name() for _ in range(rng.randint(1, 3))) for _ in range(count)]


@pytest.mark.timeout(120)
def test_random_lists_match_scontrol_show_hostnames():
    lists = _random_lists(seed=5, count=300)
    mismatches = [f"{s!r}: scontrol {_outcome(expand_scontrol, s)}, builtin {_outcome(expand_builtin, s)}"
                  for s in lists if _outcome(expand_scontrol, s) != _outcome(expand_builtin, s)]
    assert not mismatches, "\n".join(mismatches[:20])
    valid = sum(_outcome(expand_builtin, s) is not None for s in lists)
    assert 50 < valid < 250, f"the generator should mix valid and invalid lists, got {valid} valid of 300"


def test_cli_with_scontrol_parser_rejects_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "workflows.nodes", "hostnames", "n[1-2].dom", "--parser", "scontrol"],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "workflows.nodes: invalid node list 'n[1-2].dom': Invalid hostlist: n[1-2].dom\n"


@pytest.mark.timeout(120)
def test_env_inside_a_two_node_job_lists_both_nodes(slurm):
    job = slurm.run(["--nodes=2", f"--export=ALL,PYTHONPATH={REPO}",  # this checkout's workflows
                     "--wrap", f"{sys.executable} -m workflows.nodes env"], timeout=90)
    assert job.state == "COMPLETED", job.describe()
    exports = dict(re.findall(r"^export (\w+)=(\S*)$", job.output, flags=re.M))
    assert exports == {
        "MASTER_ADDR": "127.0.0.11",
        "MASTER_PORT": str(master_port(int(job.job_id))),
        "NODE_IPS": "127.0.0.11,127.0.0.12",
    }, job.describe()
    # Each address was found on its own node, through one srun task per node.
    assert job.steps[f"{job.job_id}.0"] == ("COMPLETED", "node[1-2]"), job.describe()
