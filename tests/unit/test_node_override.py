"""MDPP_NODE_OF_RANK: ranks of one host act as several nodes (so cross-node transports run on one host)."""

from __future__ import annotations

import pytest

from trainer.launch.distributed import LaunchError, read_launch_env

TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "1"}


def test_override_beats_the_launchers_node_index():
    assert read_launch_env(TORCHRUN).node_index == 0  # torchrun: all 4 ranks on one node
    assert read_launch_env({**TORCHRUN, "MDPP_NODE_OF_RANK": "0,0,1,1"}).node_index == 1
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "0", "MASTER_PORT": "1"}
    assert read_launch_env({**slurm, "MDPP_NODE_OF_RANK": "0,3,3,3"}).node_index == 3


@pytest.mark.parametrize("text", ["0,0,1", "0,0,1,1,1", "a,b,c,d", "0,-1,1,1", ""])
def test_bad_override_names_the_variable_and_value(text):
    with pytest.raises(LaunchError, match=f"MDPP_NODE_OF_RANK={text!r}"):
        read_launch_env({**TORCHRUN, "MDPP_NODE_OF_RANK": text})
