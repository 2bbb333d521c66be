"""Pure parts of the transport: channel plan per topology, header wire format, option validation."""

from __future__ import annotations

import re

import pytest
import torch

from trainer.launch.topology import Topology
from trainer.transport import Header, LinkOptions, TransportError, make_stage_links, plan_channels
from trainer.transport.tensors import as_bytes, check_matches, from_bytes, header_for
from trainer.transport.wire import HEADER_WORDS, decode, encode, pack, unpack


def _topo(**kw) -> Topology:
    return Topology(**{"world_size": 8, "rank": 0, "tensor_parallel": 2, "pipeline_parallel": 4, **kw})


def test_plan_has_two_channels_per_rank_between_same_tp_dp_neighbours():
    topo = _topo()
    plan = plan_channels(topo, "gloo", torch.device("cpu"))
    assert len(plan) == 2 * topo.world_size
    for spec in plan:
        assert topo.coords(spec.src)[:2] == topo.coords(spec.dst)[:2], spec
        step = 1 if spec.direction == "next" else -1
        assert topo.coords(spec.dst)[2] == (topo.coords(spec.src)[2] + step) % 4, spec
    wraps = [s for s in plan if s.direction == "next" and topo.coords(s.src)[2] == 3]
    assert {topo.coords(s.dst)[2] for s in wraps} == {0}  # interleaving's wrap-around edge exists


def test_auto_uses_shm_within_a_node_and_gloo_or_nccl_across_by_node_index_only():
    # Two "nodes" of 4 ranks each (launcher node index, never hostnames): stages 0-1 on node 0.
    topo = _topo(node_of_rank=(0, 0, 0, 0, 1, 1, 1, 1))
    for device, remote in (("cpu", "gloo"), ("cuda", "nccl")):
        plan = plan_channels(topo, "auto", torch.device(device))
        for spec in plan:
            expected = "shm" if topo.same_node(spec.src, spec.dst) else remote
            assert spec.transport == expected, spec
        assert {s.transport for s in plan} == {"shm", remote}


def test_pp2_keeps_next_and_prev_as_distinct_channels_to_the_same_peer():
    plan = plan_channels(Topology(world_size=2, rank=0, pipeline_parallel=2), "gloo", torch.device("cpu"))
    assert [(s.src, s.dst, s.direction) for s in plan] == [(0, 1, "next"), (0, 1, "prev"), (1, 0, "next"), (1, 0, "prev")]


def test_pp1_has_no_links_and_needs_no_process_group():
    links = make_stage_links(Topology(world_size=1, rank=0), "auto", "cpu")
    assert links.poll() is None
    with pytest.raises(TransportError, match="no incoming channels"):
        links.wait_any(0.1)
    with pytest.raises(ValueError, match="no 'next' channel"):
        links.send("next", torch.zeros(1), header_for(torch.zeros(1), "act", 0, 0))
    links.close()


@pytest.mark.parametrize(
    ("transport", "device", "match"),
    [("tcp", "cpu", "transport='tcp'"), ("gloo", "cuda", "gloo"), ("nccl", "cpu", "nccl"), ("auto", "meta", "meta")],
)
def test_bad_transport_or_device_is_named(transport, device, match):
    with pytest.raises(ValueError, match=match):
        plan_channels(_topo(), transport, torch.device(device))


def test_shm_across_nodes_is_refused_naming_ranks_and_nodes():
    with pytest.raises(ValueError, match=r"ranks 0 \(node 0\) and 6 \(node 1\)"):
        plan_channels(_topo(node_of_rank=(0, 0, 0, 0, 1, 1, 1, 1)), "shm", torch.device("cpu"))


def test_link_options_name_every_bad_value():
    with pytest.raises(ValueError) as info:
        LinkOptions(credits=0, shm_slot_bytes=100, poll_interval_s=0)
    assert all(s in str(info.value) for s in ("credits=0", "shm_slot_bytes=100", "poll_interval_s=0"))


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 1024, 2048), (1,) * 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "bool", "complex64"])
def test_header_wire_round_trip(shape, dtype):
    header = Header("grad", 12345, 3, dtype, shape)
    frame = decode(unpack(pack(encode(header, sequence=77))))
    assert frame.header == header and frame.sequence == 77 and not frame.end_of_stream
    assert decode(encode(None, 5)).end_of_stream


def test_decoded_headers_are_shared_per_distinct_header_from_lists_and_tuples():
    a, b = Header("act", 4, 1, "bfloat16", (8, 2)), Header("act", 5, 1, "bfloat16", (8, 2))
    first = decode(unpack(pack(encode(a, 0))))
    again = decode(list(encode(a, 9)))  # the gloo/NCCL path decodes a list
    other = decode(encode(b, 1))
    assert first.header is again.header and again.sequence == 9 and first.nbytes == 32
    assert other.header == b and other.header is not first.header
    eos = decode(encode(None, 3))
    assert eos.header is None and eos.sequence == 3


@pytest.mark.parametrize(
    ("header", "named"),
    [
        (Header("act", -1, 0, "float32", (2,)), "microbatch=-1"),
        (Header("act", 0, -2, "float32", (2,)), "chunk=-2"),
        (Header("act", 0, 0, "float32", (2, -3)), "negative dim"),
        (Header("act", 0, 0, "int4", (2,)), "dtype='int4'"),
    ],
)
def test_every_bad_header_field_is_refused_and_named(header, named):
    t = torch.zeros(1)
    with pytest.raises(ValueError, match=re.escape(named)):
        check_matches(t, header)


def test_corrupt_header_is_a_transport_error():
    words = encode(Header("act", 0, 0, "float32", (2,)), 0)
    with pytest.raises(TransportError, match="corrupt"):
        decode([0, *words[1:]])
    assert len(words) == HEADER_WORDS


def test_header_must_describe_the_tensor():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype=float32 shape=\(2, 3\).*dtype=bfloat16"):
        check_matches(t, Header("act", 0, 0, "float32", (2, 3)))
    with pytest.raises(ValueError, match="kind='fwd'.*more than 8 dims"):
        check_matches(t, Header("fwd", 0, 0, "bfloat16", (1,) * 9))  # type: ignore[arg-type]


def test_bytes_round_trip_of_a_non_contiguous_bfloat16_tensor():
    t = torch.randn(6, 5).to(torch.bfloat16).t()[1:]
    assert not t.is_contiguous()
    back = from_bytes(as_bytes(t).clone(), header_for(t, "act", 0, 0))
    assert torch.equal(back, t)
