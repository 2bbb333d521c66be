import pytest

from trainer.launch.topology import Topology, nodes_from_local_world_size


def test_megatron_rank_order_tp_fastest_pp_slowest():
    topo = Topology(world_size=8, rank=5, tensor_parallel=2, pipeline_parallel=2)
    assert topo.data_parallel == 2
    assert topo.coords() == (1, 0, 1)
    assert [topo.coords(r) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)
    ]
    assert topo.next_stage_rank == 1 and topo.prev_stage_rank == 1  # ring of two stages


def test_neighbours_wrap_around_for_interleaving():
    topo = Topology(world_size=4, rank=3, pipeline_parallel=4, virtual_pipeline=2)
    assert topo.is_last_stage and topo.next_stage_rank == 0 and topo.prev_stage_rank == 2


def test_bad_layout_names_every_value():
    with pytest.raises(ValueError) as e:
        Topology(world_size=6, rank=7, tensor_parallel=4, pipeline_parallel=1)
    assert "world_size=6" in str(e.value) and "tensor_parallel=4" in str(e.value)
    assert "rank=7" in str(e.value)


def test_node_membership_comes_from_launcher():
    nodes = nodes_from_local_world_size(4, 2)
    topo = Topology(world_size=4, rank=0, pipeline_parallel=4, node_of_rank=nodes)
    assert topo.same_node(0, 1) and not topo.same_node(1, 2)
    with pytest.raises(ValueError, match="local_world_size=3"):
        nodes_from_local_world_size(4, 3)
