"""The prototype's flags with the prototype's meaning: --num-gpus per node,
--node-ips per rank (or per node, detected), --multi-node needing nodes and cross-node links, and
--workload an integer (elements per shared-memory copy), the run name moving to --run-name."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.launch.distributed import LaunchError, ranks_per_node_from_env, read_launch_env
from trainer.launch.node_addresses import read_node_ips

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]


def test_node_ips_one_per_rank_give_each_rank_its_node() -> None:
    addresses, problems = read_node_ips(["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"], 4)
    assert problems == [] and addresses is not None
    assert addresses.per_rank and addresses.nodes == ("10.0.0.1", "10.0.0.2")
    assert addresses.node_of_rank == (0, 0, 1, 1)


def test_node_ips_one_per_node_are_detected() -> None:
    addresses, problems = read_node_ips(["10.0.0.1", "10.0.0.2"], 8)
    assert problems == [] and addresses is not None
    assert not addresses.per_rank and addresses.node_of_rank is None and addresses.nodes == ("10.0.0.1", "10.0.0.2")


@pytest.mark.parametrize(("ips", "world", "needle"), [
    (["a", "a", "b"], 4, "3 addresses with repeats: one address per rank needs exactly 4"),
    (["a", "b", "c"], 4, "3 addresses: neither one per rank (4) nor one per node"),
    (["a", "a", "a", "b"], 4, "the nodes run different numbers of ranks (a: 3, b: 1)"),
    (["a", "a", "a", "b", "b"], 4, "5 addresses with repeats for 4 ranks: read one per rank as the prototype does"),
])
def test_node_ips_that_fit_neither_form_are_refused(ips, world, needle) -> None:
    assert read_node_ips(ips, world)[0] is None
    with pytest.raises(ConfigError, match=r"--node-ips=" + ",".join(ips)) as err:
        parse_config(BASE + ["--node-ips", ",".join(ips)], world_size=world)
    assert needle in str(err.value)


def test_per_rank_node_ips_place_ranks_without_host_lookups() -> None:
    """The prototype's form names every rank's node; this host's name plays no part."""
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"}
    info = read_launch_env(env, node_ips=("192.0.2.1", "192.0.2.1", "192.0.2.9", "192.0.2.9"))
    assert info.node_index == 1 and info.master_addr == "192.0.2.1"
    one_each = read_launch_env({**env, "LOCAL_WORLD_SIZE": "1"}, node_ips=("h0", "h1", "h2", "h3"))
    assert one_each.node_index == 2


def test_num_gpus_places_ranks_where_the_launcher_does_not() -> None:
    """No LOCAL_RANK / LOCAL_WORLD_SIZE: rank // N is the node and rank % N the GPU, the prototype's rule."""
    info = read_launch_env({"RANK": "5", "WORLD_SIZE": "8", "MASTER_PORT": "1"}, num_gpus=4)
    assert (info.node_index, info.local_rank) == (1, 1)
    with pytest.raises(LaunchError, match="neither one per rank"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "1"}, node_ips=("a", "b", "c"))


@pytest.mark.parametrize(("env", "expected"), [
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 4),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 4),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "5", "SLURM_STEP_TASKS_PER_NODE": "3,2"}, None),
    ({}, None),
])
def test_ranks_per_node_from_the_launcher(env, expected) -> None:
    assert ranks_per_node_from_env(env) == expected


def test_num_gpus_is_gpus_per_node() -> None:
    cfg = parse_config(BASE + ["--num-gpus", "4", "--node-ips", "10.0.0.1,10.0.0.2"], world_size=8, ranks_per_node=4)
    assert cfg.run.num_gpus == 4
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--num-gpus", "4"], world_size=8, ranks_per_node=8)
    assert err.value.problems == ["ranks per node disagree: the launcher says 8, --num-gpus=4 says 4 (world size 8)"]
    with pytest.raises(ConfigError, match=r"--node-ips \(4 nodes, addresses per node\) says 2"):
        parse_config(BASE + ["--num-gpus", "4", "--node-ips", "a,b,c,d"], world_size=8)


def test_multi_node_needs_several_nodes_and_cross_node_links() -> None:
    parse_config(BASE + ["--multi-node", "--node-ips", "a,a,b,b"], world_size=4)
    parse_config(BASE + ["--multi-node"], world_size=4)  # nothing known yet: checked once ranks report nodes
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--multi-node", "--transport", "shm", "--num-gpus", "4"], world_size=4)
    assert set(err.value.problems) == {
        "--multi-node but every rank is on one node (--num-gpus=4: 4 ranks per node)",
        "--multi-node with --transport shm: shared memory does not cross nodes; use --transport auto "
        "(shm within a node, nccl/gloo between nodes), nccl or gloo"}
    with pytest.raises(ConfigError, match="--multi-node but every rank is on one node"):
        parse_config(BASE + ["--multi-node"], world_size=4, ranks_per_node=4)


def test_workload_is_the_prototypes_integer_and_sizes_the_shm_slots() -> None:
    from trainer.schedule.core import PipelineShape
    from trainer.train import link_options

    cfg = parse_config(BASE + ["--workload", "524288", "--bf16", "--run-name", "gpt-dpp"], world_size=1)
    assert (cfg.run.workload, cfg.run.run_name) == (524288, "gpt-dpp")
    shape = PipelineShape(2, 4, 1)
    assert link_options(cfg, shape).shm_slot_bytes == 524288 * 2  # the prototype's 1 MiB of fp16 per copy
    default = link_options(parse_config(BASE + ["--bf16"], world_size=1), shape)
    assert default.shm_slot_bytes == 8192  # one activation: seq 64 x mbs 1 x hidden 64 x 2 bytes
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--workload", "1000", "--bf16"], world_size=1)
    assert err.value.problems == ["--workload=1000 elements x 2 bytes is below the 4096-byte shared-memory slot "
                                  "minimum (give at least 2048)"]
    with pytest.raises(ConfigError, match="--workload=0 must be >= 1"):
        parse_config(BASE + ["--workload", "0"], world_size=1)
    with pytest.raises(SystemExit):  # no longer a name: the parser refuses a non-integer (exit 2, one line)
        parse_config(BASE + ["--workload", "gpt16"], world_size=1)


def test_the_prototypes_single_node_example_list_is_read_as_the_prototype_reads_it() -> None:
    """Its train_gpt3_175b_distributed.sh passes 8 addresses (2 nodes x 4) with GPUS_PER_NODE=4, NUM_NODES=1.
    The prototype gives rank r the r-th address, so its 4 ranks take the first 4 (one node) and the rest
    go unused; read the same way here, the unused ones kept for the trainer's warning. The same list on
    8 ranks is the two-node per-rank form."""
    ips = "192.168.0.7,192.168.0.7,192.168.0.7,192.168.0.7,192.168.0.2,192.168.0.2,192.168.0.2,192.168.0.2"
    cfg = parse_config(BASE + ["--node-ips", ips, "--num-gpus", "4", "--workload", str(2048 * 512)], world_size=4,
                       ranks_per_node=4)
    addresses, problems = read_node_ips(cfg.run.node_ips, 4)
    assert problems == [] and addresses is not None
    assert (addresses.per_rank, addresses.nodes, addresses.node_of_rank) == (True, ("192.168.0.7",), (0, 0, 0, 0))
    assert addresses.unused == ("192.168.0.2",) * 4
    with pytest.raises(ConfigError, match="--multi-node but every rank is on one node"):
        parse_config(BASE + ["--node-ips", ips, "--num-gpus", "4", "--multi-node"], world_size=4, ranks_per_node=4)
    cfg = parse_config(BASE + ["--node-ips", ips, "--num-gpus", "4", "--multi-node"], world_size=8, ranks_per_node=4)
    assert cfg.run.node_ips == tuple(ips.split(","))  # the same list on its two nodes
    assert read_node_ips(cfg.run.node_ips, 8)[0].unused == ()
