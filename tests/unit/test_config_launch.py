"""trainer.launch.distributed.read_launch_env: torchrun and srun variables -> rank, world and node."""

from __future__ import annotations

import pytest

from trainer.launch.distributed import LaunchError, read_launch_env


def test_torchrun_node_is_rank_over_local_world_size() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    info = read_launch_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.node_index) == (5, 8, 1, 1)
    assert (info.master_addr, info.master_port, info.launcher) == ("10.0.0.1", 29400, "torchrun")


def test_torchrun_under_slurm_takes_the_node_from_slurm() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "SLURM_NODEID": "3", "MASTER_PORT": "1"}
    assert read_launch_env(env).node_index == 3


def test_srun_task_per_rank() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "MASTER_ADDR": "node1", "MASTER_PORT": "12345"}
    info = read_launch_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.node_index, info.launcher) == (6, 8, 2, 1, "slurm")


def test_no_launcher_is_a_single_process() -> None:
    info = read_launch_env({})
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "single")


def test_node_ips_place_this_host() -> None:
    # Two addresses for four ranks: one per node (a list as long as the world is one per rank).
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"}
    import socket

    info = read_launch_env(env, node_ips=("192.0.2.77", socket.gethostname()))
    assert info.node_index == 1


@pytest.mark.parametrize(("env", "needle"), [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "rank 2 is outside world size 2"),
])
def test_bad_launcher_environment_names_the_variable(env, needle) -> None:
    with pytest.raises(LaunchError, match=needle):
        read_launch_env(env)


def test_node_ips_longer_than_the_world_place_ranks_by_their_own_address(caplog) -> None:
    """The prototype's single-node example: 8 addresses for 4 ranks; rank r takes the r-th (all on the
    first node) and rank 0 warns which addresses go unused."""
    ips = ("192.0.2.7",) * 4 + ("192.0.2.2",) * 4
    with caplog.at_level("WARNING"):
        nodes = [read_launch_env({"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "1"}, node_ips=ips).node_index
                 for r in range(4)]
    assert nodes == [0, 0, 0, 0]
    warned = [r.getMessage() for r in caplog.records if "--node-ips" in r.getMessage()]
    assert len(warned) == 1 and "4 address(es) past rank 3 not used" in warned[0], warned
