"""trainer.pipeline.cuda_graphs without a GPU: slot bookkeeping, the replay stand-in's two input paths
(the first stage's eager embedding into ``decoder_input``; a later stage's set_input_tensor), which
parameters a slot differentiates, and what --dpp-cuda-graphs refuses before any process starts.

Here the "capture" returns the module uncaptured (no CUDA): what is checked is everything around the
graph. tests/gpu/test_dpp_cuda_graphs.py checks the graphs themselves against eager DPP on a GPU.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from trainer.bench.lines import BenchConfig, NotRun, plan
from trainer.config import ConfigError, parse_config, resolve_plan
from trainer.pipeline.cuda_graphs import ChunkGraphs, GraphShapes, Replay, _BlockCall

S, B, H, V = 6, 2, 4, 11


class _Embedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word = torch.nn.Embedding(V, H)

    def forward(self, input_ids, position_ids):
        return (self.word(input_ids) + position_ids.unsqueeze(-1)).transpose(0, 1)  # [s, b, h] like megatron


class _Block(torch.nn.Module):
    """TransformerBlock's conventions: input from hidden_states on the first stage, else set_input_tensor."""

    def __init__(self, pre_process: bool) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.lin = torch.nn.Linear(H, H)
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, hidden_states=None, attention_mask=None, rotary_pos_emb=None):
        if not self.pre_process:
            hidden_states = self.input_tensor
        return torch.tanh(self.lin(hidden_states)) + attention_mask.float().mean()


class _TinyGPT(torch.nn.Module):
    """GPTModel's calling convention: embedding on the first stage, the block always, head and loss
    (given labels) on the last; set_input_tensor reaches the block."""

    def __init__(self, pre_process: bool, post_process: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = _Embedding() if pre_process else None
        self.decoder = _Block(pre_process)
        self.head = torch.nn.Linear(H, V) if post_process else None

    def set_input_tensor(self, tensors) -> None:
        self.decoder.set_input_tensor(tensors[0])

    def forward(self, input_ids, position_ids, attention_mask, labels=None, rotary_pos_emb=None):
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else None
        hidden = self.decoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        if not self.post_process:
            return hidden
        logits = self.head(hidden).transpose(0, 1)  # [b, s, V]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")


def _uncaptured(call, shapes, masks, device):
    """capture_slot's contract without CUDA: one callable(x, attention_mask) per captured length."""
    return {n: call for n in shapes.captured_lengths()}


def _graphs(chunk, first: bool, slots: int = 2, lengths: tuple[int, ...] = ()) -> ChunkGraphs:
    shapes = GraphShapes(activation=(S, B, H), activation_dtype=torch.float32, tokens=(B, S), lengths=lengths)
    masks = {n: torch.ones(1, 1, n, n, dtype=torch.bool) for n in shapes.captured_lengths()}
    return ChunkGraphs(chunk, first, slots, shapes, masks, torch.device("cpu"), capture=_uncaptured)


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, V, (B, S), generator=g), torch.arange(S).expand(B, S),
            torch.ones(1, 1, S, S, dtype=torch.bool))


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _replayed(chunk, first: bool, m: int, x, *args, **kwargs):
    graphs = _graphs(chunk, first=first)
    return Replay(graphs, graphs.take(m, x), chunk)(*args, **kwargs)


def test_first_stage_replay_embeds_eagerly_and_matches_the_chunk() -> None:
    tokens, pos, mask = _batch()
    ref = _TinyGPT(pre_process=True)
    ref(tokens, pos, mask).square().sum().backward()
    chunk = _TinyGPT(pre_process=True)
    out = _replayed(chunk, True, 0, tokens, tokens, pos, mask, labels=None)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref(tokens, pos, mask))
    want, got = _grads(ref), _grads(chunk)
    assert sorted(got) == sorted(want)  # the embedding's gradient too: it runs outside the graph
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    assert "forward" not in vars(chunk.decoder)  # the swap lasted one call


def _received(x, pre_process=False, post_process=False):
    chunk = _TinyGPT(pre_process=pre_process, post_process=post_process)
    x_in = x.clone().requires_grad_()
    chunk.set_input_tensor([x_in])
    return chunk, x_in


def test_later_stages_replay_the_received_activation_and_the_last_keeps_its_head_eager() -> None:
    tokens, pos, mask = _batch()
    x = torch.randn(S, B, H)
    for post_process in (False, True):
        ref, x_ref = _received(x, post_process=post_process)
        chunk, x_in = _received(x, post_process=post_process)
        labels = tokens if post_process else None
        ref(None, pos, mask, labels=labels).sum().backward()
        out = _replayed(chunk, False, 3, x_in, None, pos, mask, labels=labels)
        out.sum().backward()
        torch.testing.assert_close(out, ref(None, pos, mask, labels=labels))
        torch.testing.assert_close(x_in.grad, x_ref.grad)
        want, got = _grads(ref), _grads(chunk)
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name])


def test_a_block_argument_the_capture_did_not_see_is_an_error() -> None:
    tokens, pos, mask = _batch()
    chunk, x_in = _received(torch.randn(S, B, H))
    with pytest.raises(RuntimeError, match="got rotary_pos_emb, which its CUDA graph did not capture"):
        _replayed(chunk, False, 0, x_in, None, pos, mask, rotary_pos_emb=torch.ones(1))
    assert "forward" not in vars(chunk.decoder)


def test_a_slot_differentiates_only_the_transformer_block() -> None:
    # An unused parameter (the first stage's embedding) broke backward capture on the GPU.
    chunk = _TinyGPT(pre_process=True, post_process=True)
    assert {n for n, _ in _BlockCall(chunk).named_parameters()} == {"decoder.lin.weight", "decoder.lin.bias"}


def test_slots_are_taken_by_forwards_and_given_back_by_backwards() -> None:
    graphs = _graphs(_TinyGPT(pre_process=False), first=False, slots=2)
    x = torch.zeros(S, B, H)
    a, b = graphs.take(0, x), graphs.take(1, x)
    assert a is not None and b is not None and a is not b
    assert graphs.take(2, x) is None  # every slot holds an activation: eager
    assert graphs.in_use() == [0, 1]
    assert graphs.give_back(0)
    assert not graphs.give_back(2)  # ran eagerly: nothing to give back
    assert graphs.take(4, x) is a and graphs.in_use() == [1, 4]
    assert graphs.take(5, torch.zeros(S + 1, B, H)) is None  # a shape that was not captured
    assert graphs.take(6, x.half()) is None  # nor a dtype
    with torch.no_grad():
        assert graphs.take(7, x) is None  # inference never takes a slot, and is not counted
    assert (graphs.replayed, graphs.eager) == (3, 3)
    with pytest.raises(ValueError, match="at least one graph slot"):
        _graphs(_TinyGPT(pre_process=False), first=False, slots=0)


def test_each_chunks_warm_up_cache_is_released_before_its_slots_capture(monkeypatch) -> None:
    """The warm-up's eager blocks stay cached in the ordinary pool, which no capture draws from; kept
    through the captures they set the run's peak reserved memory (graphs + warm-up, during set-up).
    So each chunk's cache goes back between its warm-up(s) and its first capture, and once more after
    all of them. CUDA itself is absent here: warm-up runs on CPU, the capture and the release are
    recorded stand-ins (tests/gpu/test_dpp_cuda_graphs.py checks the peak on a GPU)."""
    from types import SimpleNamespace

    from trainer.pipeline import cuda_graphs, stage_graphs

    events = []
    warm_up = cuda_graphs._warm_up

    def recorded_warm_up(call, *args, **kwargs):
        events.append(("warm-up", call.decoder.tag))
        return warm_up(call, *args, **kwargs)

    def recorded_capture(call, shapes, masks, device, **kwargs):
        events.append(("capture", call.decoder.tag))
        return _uncaptured(call, shapes, masks, device)

    monkeypatch.setattr(cuda_graphs, "_warm_up", recorded_warm_up)
    monkeypatch.setattr(cuda_graphs, "capture_slot", recorded_capture)
    monkeypatch.setattr(cuda_graphs, "release_cached_blocks", lambda device: events.append(("release",)))
    for name, value in {"graph_pool_handle": lambda: "pool", "memory_reserved": lambda device=None: 0,
                        "max_memory_reserved": lambda device=None: 0,
                        "max_memory_allocated": lambda device=None: 0}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    chunks = [_TinyGPT(pre_process=False), _TinyGPT(pre_process=False)]
    for c, chunk in enumerate(chunks):
        chunk.decoder.tag = c
        chunk.decoder.attn = _Attention()
    shapes = GraphShapes(activation=(S, B, H), activation_dtype=torch.float32, tokens=(B, S))
    masks = {S: torch.ones(1, 1, S, S, dtype=torch.bool)}
    shape = SimpleNamespace(is_first_virtual=lambda stage, c: False)
    graphs = stage_graphs.capture_chunk_graphs(chunks, shape, 1, (2, 3), shapes, masks, torch.device("cpu"),
                                              recompute_slots=1)
    # recompute_slots: two warm-ups per chunk (both attention code paths); every chunk warms up before any
    # captures (the stage's shared evacuation sets are sized from all their plans); a release before each
    # chunk's captures
    assert events == [("warm-up", 0), ("warm-up", 0), ("warm-up", 1), ("warm-up", 1), ("release",),
                      ("capture", 0), ("capture", 0), ("release",), *[("capture", 1)] * 3, ("release",)]
    assert [len(g.slots) for g in graphs.values()] == [2, 3]
    assert all(p.grad is None for chunk in chunks for p in chunk.parameters())  # the warm-up left no gradient


class _SplitStandIn:
    """What capture_slot returns with a split backward, without CUDA: the block, plus a W that counts."""

    def __init__(self, call) -> None:
        self.call, self.weights = call, 0

    def __call__(self, x, attention_mask=None):
        return self.call(x, attention_mask)

    def replay_weights(self) -> None:
        self.weights += 1


def test_with_a_split_backward_the_slot_is_held_until_its_w_replays() -> None:
    """dpp-zb: the slot's activations are read by W, so I must not free it; W replays the slot's W
    (of the length the forward took) and frees it. An eager microbatch has no W graph to replay."""
    shapes = GraphShapes(activation=(S, B, H), activation_dtype=torch.float32, tokens=(B, S), lengths=(2, S))
    masks = {n: torch.ones(1, 1, n, n, dtype=torch.bool) for n in shapes.captured_lengths()}
    capture = lambda call, shapes, masks, device: {n: _SplitStandIn(call) for n in shapes.captured_lengths()}  # noqa: E731
    graphs = ChunkGraphs(_TinyGPT(pre_process=False), False, 1, shapes, masks, torch.device("cpu"), capture=capture)
    short = graphs.take(0, torch.zeros(2, B, H))
    assert short is graphs.slots[0][2] and graphs.holds(0) and not graphs.holds(1)
    assert graphs.take(1, torch.zeros(S, B, H)) is None  # the one slot waits for microbatch 0's W
    assert not graphs.replay_weights(1)  # eager: its GEMMs are in the runtime's store
    assert graphs.replay_weights(0) and short.weights == 1 and graphs.slots[0][S].weights == 0
    assert graphs.in_use() == [] and not graphs.replay_weights(0)
    assert graphs.take(2, torch.zeros(S, B, H)) is graphs.slots[0][S]
    # A stand-in without a W graph (the eager linears deferred into the runtime's store): freed all the same.
    plain = _graphs(_TinyGPT(pre_process=False), first=False, slots=1)
    plain.take(0, torch.zeros(S, B, H))
    assert plain.replay_weights(0) and plain.in_use() == []


def test_variable_lengths_replay_their_own_length_and_share_the_slot() -> None:
    """--variable-seq-lengths: a slot holds one replay per bucket length; a microbatch takes the slot
    and replays its length's pair, and an uncaptured length runs eagerly."""
    seen = []

    def capture(call, shapes, masks, device):
        seen.append(shapes.captured_lengths())
        return {n: (n, call) for n in shapes.captured_lengths()}  # tagged, to see which one is handed out

    shapes = GraphShapes(activation=(S, B, H), activation_dtype=torch.float32, tokens=(B, S), lengths=(2, 4, S))
    masks = {n: torch.ones(1, 1, n, n, dtype=torch.bool) for n in (2, 4, S)}
    later = ChunkGraphs(_TinyGPT(pre_process=False), False, 2, shapes, masks, torch.device("cpu"), capture=capture)
    assert seen == [(S, 4, 2)] * 2  # longest first: its capture sizes the slot's pool, the others reuse it
    assert later.take(0, torch.zeros(4, B, H))[0] == 4
    assert later.take(1, torch.zeros(S, B, H))[0] == S
    assert later.take(2, torch.zeros(2, B, H)) is None  # both slots taken
    assert later.give_back(0) and later.take(2, torch.zeros(2, B, H))[0] == 2
    assert later.take(3, torch.zeros(3, B, H)) is None and later.give_back(1)
    assert later.take(4, torch.zeros(3, B, H)) is None  # free slot, but 3 was not captured: eager
    assert later.take(5, torch.zeros(4, B + 1, H)) is None  # another batch size neither
    first = ChunkGraphs(_TinyGPT(pre_process=True), True, 1, shapes, masks, torch.device("cpu"), capture=capture)
    assert first.take(0, torch.zeros(B, 4, dtype=torch.long))[0] == 4  # the first stage reads tokens [b, s]
    with pytest.raises(ValueError, match=r"no attention mask for captured length\(s\) \[4\]"):
        ChunkGraphs(_TinyGPT(pre_process=False), False, 1, shapes, {2: masks[2], S: masks[S]},
                    torch.device("cpu"), capture=capture)


def test_bucket_lengths_are_every_length_a_microbatch_can_have() -> None:
    from trainer.data.varlen import bucket_length, bucket_lengths

    for multiple, seq in ((64, 1024), (64, 100), (128, 128), (3, 10), (16, 8)):
        got = bucket_lengths(multiple, seq)
        assert got == tuple(sorted({bucket_length([n], multiple, seq) for n in range(1, seq + 1)})), (multiple, seq)
    assert bucket_lengths(64, 1024)[:3] == (64, 128, 192) and bucket_lengths(64, 100) == (64, 100)


GOOD = ["--mock-data", "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--device", "cuda", "--use-dpp",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--dpp-cuda-graphs"]


def test_graphs_config_is_accepted_where_it_can_run() -> None:
    assert parse_config(GOOD, world_size=2).parallel.dpp_cuda_graphs
    varlen = parse_config(GOOD + ["--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.5",
                                 "--seq-length-divisible-by", "4"], world_size=2)
    assert varlen.parallel.dpp_cuda_graphs and varlen.data.variable_seq_lengths
    split = parse_config(GOOD + ["--dpp-policy", "dpp-zb"], world_size=2)  # F, I and W graphs per slot
    assert split.parallel.dpp_cuda_graphs and split.parallel.dpp_policy == "dpp-zb"
    # TP collectives captured into the graphs (NCCL: the default backend on CUDA), with and without SP
    tp = parse_config(GOOD + ["--tensor-model-parallel-size", "2"], world_size=4)
    assert tp.parallel.dpp_cuda_graphs and tp.parallel.tensor_model_parallel_size == 2
    sp = parse_config(GOOD + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--distributed-backend", "nccl"], world_size=4)
    assert sp.parallel.sequence_parallel and sp.parallel.dpp_cuda_graphs
    # dropout: a graph-safe RNG draws fresh masks every replay (Megatron-LM's default 0.1)
    drop = parse_config([a for a in GOOD if a not in ("--hidden-dropout", "--attention-dropout", "0")], world_size=2)
    assert (drop.model.hidden_dropout, drop.model.attention_dropout) == (0.1, 0.1) and drop.parallel.dpp_cuda_graphs
    assert parse_config(GOOD + ["--model", "bert"], world_size=2).parallel.dpp_cuda_graphs


@pytest.mark.parametrize("extra, needle", [
    (["--device", "cpu"], "--device cuda (got cpu)"),
    (["--tensor-model-parallel-size", "2", "--distributed-backend", "gloo"],
     "--distributed-backend nccl with --tensor-model-parallel-size 2"),
    (["--hidden-dropout", "0.1", "--recompute-activations"], "no recompute with dropout (got --hidden-dropout 0.1"),
    (["--attention-dropout", "0.1", "--dpp-recompute-slots", "1"], "no recompute with dropout"),
    (["--variable-seq-lengths", "--mock-seq-len-dist", "lognormal:0.5", "--seq-length-divisible-by", "1",
      "--seq-length", "64", "--max-position-embeddings", "64"],
     "at most 32 sequence lengths to capture with --variable-seq-lengths"),
])
def test_graphs_refuse_what_they_cannot_capture(extra, needle) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(GOOD + extra, world_size=4 if "--tensor-model-parallel-size" in extra else 2)
    assert f"--dpp-cuda-graphs needs {needle}" in str(err.value)


@pytest.mark.parametrize("policy, extra", [("zb-h1", []), ("1f1b", []),
                                           ("interleaved", ["--num-virtual-stages-per-pipeline-rank", "2"])])
def test_graphs_replay_the_static_orders_under_dpp(policy, extra) -> None:
    cfg = parse_config(GOOD + ["--dpp-policy", policy] + extra, world_size=2)
    schedule = resolve_plan(cfg, 2).schedule
    assert schedule.cuda_graphs and schedule.engine == "runtime" and schedule.policy == policy


@pytest.mark.parametrize("extra, needle", [
    (["--dpp-policy", "1f1b", "--num-virtual-stages-per-pipeline-rank", "2"],
     "--dpp-policy=1f1b needs one model chunk per stage, got 2"),
    (["--dpp-policy", "interleaved"], "--dpp-policy=interleaved needs two or more model chunks per stage"),
    (["--dpp-policy", "1f1b", "--dpp-cap-factor", "1.5"], "--dpp-cap-factor=1.5 applies to --use-dpp with"),
    (["--dpp-policy", "interleaved", "--dpp-max-inflight", "3", "--num-virtual-stages-per-pipeline-rank", "2"],
     "not to the static interleaved"),
])
def test_static_orders_refuse_what_their_order_cannot_run(extra, needle) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(GOOD + extra, world_size=2)
    assert needle in str(err.value)


def test_static_1f1b_needs_the_dpp_runtime() -> None:
    argv = [a for a in GOOD if a not in ("--use-dpp", "--dpp-cuda-graphs")] + ["--dpp-policy", "1f1b"]
    with pytest.raises(ConfigError, match=r"--dpp-policy=1f1b needs --use-dpp"):
        parse_config(argv, world_size=2)


def test_graphs_without_dpp_are_refused() -> None:
    argv = [a for a in GOOD if a != "--use-dpp"]
    with pytest.raises(ConfigError, match=r"--dpp-cuda-graphs needs --use-dpp"):
        parse_config(argv, world_size=2)


MEGATRON_GRAPHS = [a for a in GOOD if a not in ("--use-dpp", "--dpp-cuda-graphs")] + [
    "--cuda-graph-impl", "local", "--pipeline-model-parallel-size", "1"]


def test_megatron_graphs_reach_megatron_core_config() -> None:
    """--cuda-graph-impl local is megatron-core's own per-layer graphs (Megatron-LM's flag), for its schedules."""
    from trainer.launch.topology import Topology
    from trainer.model.build import transformer_config

    cfg = parse_config(MEGATRON_GRAPHS + ["--cuda-graph-warmup-steps", "2"], world_size=1)
    assert (cfg.parallel.cuda_graph_impl, cfg.parallel.cuda_graph_warmup_steps) == ("local", 2)
    # built as on CPU (no CUDA fusions to look for): the graph fields are what matter here
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device="cpu"))
    tc = transformer_config(cfg, Topology(world_size=1, rank=0))
    assert (tc.cuda_graph_impl, tc.cuda_graph_warmup_steps) == ("local", 2)
    assert parse_config(GOOD, world_size=2).parallel.cuda_graph_impl == "none"


def test_benchmark_runs_megatron_graphs_under_a_pipeline() -> None:
    [line] = plan(BenchConfig(), ["megatron-1f1b-graphs"], ["a"], ("dpp",))
    assert not isinstance(line, NotRun) and "--cuda-graph-impl" in line.args


def test_megatron_graphs_are_accepted_under_a_pipeline() -> None:
    cfg = parse_config(MEGATRON_GRAPHS + ["--pipeline-model-parallel-size", "2"], world_size=2)
    assert (cfg.parallel.cuda_graph_impl, cfg.parallel.pipeline_model_parallel_size) == ("local", 2)


def test_megatron_graphs_give_gpt_layers_no_shared_mask_tensor() -> None:
    """The collated causal mask is one cached tensor for every microbatch: under megatron-core's graphs
    the forward step passes none (its causal attention applies its own mask), everything else as given."""
    from trainer.model.steps import causal_mask_from_attention

    seen = []

    def step(data_iterator, model):
        seen.append(next(data_iterator))
        return "out", model

    batch = {"tokens": torch.ones(1, 2), "attention_mask": torch.ones(1, 1, 2, 2, dtype=torch.bool)}
    assert causal_mask_from_attention(step)(iter([batch]), "m") == ("out", "m")
    assert seen[0]["attention_mask"] is None and seen[0]["tokens"] is batch["tokens"]
    assert batch["attention_mask"] is not None  # the cached mask itself is untouched


@pytest.mark.parametrize("extra, needle", [
    (["--use-dpp"], "megatron-core's schedules (not --use-dpp"),
    (["--device", "cpu"], "--device cuda (got cpu)"),
    (["--distributed-backend", "gloo"], "NCCL (not --distributed-backend gloo"),
])
def test_megatron_graphs_refuse_what_they_cannot_run(extra, needle) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(MEGATRON_GRAPHS + extra, world_size=2)
    assert f"--cuda-graph-impl local needs {needle}" in str(err.value)


def test_megatron_graphs_name_the_implementations_offered() -> None:
    with pytest.raises(ConfigError, match="transformer_engine"):
        parse_config(MEGATRON_GRAPHS + ["--cuda-graph-impl", "transformer_engine"], world_size=1)


def test_benchmark_lists_the_graphs_line_as_not_run_where_it_cannot() -> None:
    cuda = plan(BenchConfig(), ["dpp-graphs", "megatron-1f1b-graphs"], ["a", "b"], ("dpp",))
    assert [type(x).__name__ for x in cuda] == ["Line", "Line", "Line", "NotRun"]
    assert "--variable-seq-lengths" in cuda[2].args  # scenario (b) graphs every bucket length
    assert "capture one sequence length" in cuda[3].reason or "pipeline schedule" in cuda[3].reason
    cpu = plan(BenchConfig(device="cpu"), ["dpp-graphs"], ["a"], ("dpp",))
    assert isinstance(cpu[0], NotRun) and cpu[0].reason == "CUDA graphs need CUDA"
    assert "--dpp-cuda-graphs" in cuda[0].args


def test_capture_skips_megatrons_rng_save_and_restore_and_puts_it_back() -> None:
    """Selective recompute's checkpoint saves every RNG state in its forward and restores it for the
    recompute (a capture forbids both); inside the bypass those are no-ops, outside megatron's own."""
    from megatron.core.tensor_parallel import random as tp_random

    from trainer.pipeline.graph_rng import rng_state_bypassed

    originals = (tp_random._get_all_rng_states, tp_random._set_all_rng_states, tp_random.CudaRNGStatesTracker.fork)
    with rng_state_bypassed():
        assert tp_random._get_all_rng_states() == (None, None, None)
        assert tp_random._set_all_rng_states(None, None, None) is None
        with tp_random.get_cuda_rng_tracker().fork():  # no tracker state is needed: nothing is drawn
            pass
        assert tp_random._get_all_rng_states is not originals[0]
    assert (tp_random._get_all_rng_states, tp_random._set_all_rng_states,
            tp_random.CudaRNGStatesTracker.fork) == originals


def test_recompute_with_graphs_is_accepted() -> None:
    cfg = parse_config([*GOOD, "--recompute-activations"], world_size=2)
    assert cfg.parallel.dpp_cuda_graphs and cfg.model.recompute == "selective"


class _Attention(torch.nn.Module):
    """megatron-core's Attention reads checkpoint_core_attention on every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint_core_attention = False


def test_recompute_slots_capture_the_last_slots_recomputing_and_forwards_prefer_the_others() -> None:
    chunk = _TinyGPT(pre_process=False)
    chunk.decoder.attn = _Attention()
    seen = []

    def capture(call, shapes, masks, device):
        seen.append(chunk.decoder.attn.checkpoint_core_attention)  # what this slot's capture recorded
        return {n: ("slot", len(seen) - 1) for n in shapes.captured_lengths()}

    shapes = GraphShapes(activation=(S, B, H), activation_dtype=torch.float32, tokens=(B, S))
    masks = {S: torch.ones(1, 1, S, S, dtype=torch.bool)}
    graphs = ChunkGraphs(chunk, False, 4, shapes, masks, torch.device("cpu"), capture=capture, recompute_slots=1)
    assert seen == [False, False, False, True] and graphs.recomputes == seen
    assert chunk.decoder.attn.checkpoint_core_attention is False  # eager ops follow the configuration
    x = torch.zeros(S, B, H)
    assert [graphs.take(m, x)[1] for m in range(3)] == [0, 1, 2]
    graphs.give_back(1)
    assert graphs.take(3, x)[1] == 1  # a keeping slot is free: the recomputing one waits
    assert graphs.take(4, x)[1] == 3  # only the recomputing slot is left
    graphs.give_back(0), graphs.give_back(4)
    assert graphs.take(5, x)[1] == 0
    # without the option every slot captures what the configuration says (here: attention kept)
    seen.clear()
    plain = ChunkGraphs(chunk, False, 2, shapes, masks, torch.device("cpu"), capture=capture)
    assert seen == [False, False] and plain.recomputes == [None, None]
    chunk.decoder.attn.checkpoint_core_attention = True  # as --recompute-activations builds it
    seen.clear()
    ChunkGraphs(chunk, False, 2, shapes, masks, torch.device("cpu"), capture=capture)
    assert seen == [True, True]
    with pytest.raises(ValueError, match="3 recomputing slot"):
        ChunkGraphs(chunk, False, 2, shapes, masks, torch.device("cpu"), capture=capture, recompute_slots=3)


def test_recompute_slots_flag_is_per_stage_and_checked_before_start() -> None:
    cfg = parse_config([*GOOD, "--dpp-recompute-slots", "1"], world_size=2)
    assert cfg.parallel.dpp_recompute_slots == (1,)
    assert parse_config([*GOOD, "--dpp-recompute-slots", "2,1"], world_size=2).parallel.dpp_recompute_slots == (2, 1)
    for extra, needle in ((["--dpp-recompute-slots", "1,0,0"], "lists 3 stages; --pipeline-model-parallel-size is 2"),
                          (["--dpp-recompute-slots", "-1"], "every count must be >= 0"),
                          (["--dpp-recompute-slots", "1", "--recompute-activations"], "give one"),
                          (["--dpp-recompute-slots", "1"], None)):
        argv = [*GOOD, *extra]
        if needle is None:  # without graphs
            argv = [a for a in argv if a != "--dpp-cuda-graphs"]
            argv.append("--dpp-eager")
            needle = "needs CUDA graphs"
        with pytest.raises(ConfigError, match=re.escape(needle)):
            parse_config(argv, world_size=2)
    with pytest.raises((ConfigError, SystemExit)):
        parse_config([*GOOD, "--dpp-recompute-slots", "one"], world_size=2)


def test_graphs_default_to_deciding_one_op_ahead() -> None:
    """--dpp-max-queued-ops defaults to 1 with graphs (measured fastest on 4xH100), 0 can be asked for."""
    def queued(argv: list[str]) -> int:
        return resolve_plan(parse_config(argv, world_size=2), 2).schedule.max_queued_ops

    assert queued(GOOD) == 1
    assert queued([*GOOD, "--dpp-max-queued-ops", "0"]) == 0
    assert queued([*GOOD, "--dpp-max-queued-ops", "3"]) == 3


def test_sequence_parallel_slots_take_the_rank_shard_and_key_by_full_length() -> None:
    """--sequence-parallel: the block's input is this rank's 1/TP of the sequence; a slot is keyed by the
    full length (the first stage reads tokens [b, s]) and captured at the shard's rows."""
    seen = []

    def capture(call, shapes, masks, device):
        seen.append({n: (shapes.rows(n), tuple(masks[n].shape)) for n in shapes.captured_lengths()})
        return {n: ("len", n) for n in shapes.captured_lengths()}

    shapes = GraphShapes(activation=(S // 2, B, H), activation_dtype=torch.float32, tokens=(B, S),
                         lengths=(2, S), sequence_shards=2)
    assert shapes.captured_lengths() == (S, 2)
    assert GraphShapes(activation=(S // 2, B, H), activation_dtype=torch.float32, tokens=(B, S),
                       sequence_shards=2).captured_lengths() == (S,)
    masks = {n: torch.ones(1, 1, n, n, dtype=torch.bool) for n in (2, S)}
    later = ChunkGraphs(_TinyGPT(pre_process=False), False, 2, shapes, masks, torch.device("cpu"), capture=capture)
    assert seen[0] == {S: (S // 2, (1, 1, S, S)), 2: (1, (1, 1, 2, 2))}  # shard rows, full-length masks
    assert later.take(0, torch.zeros(S // 2, B, H)) == ("len", S)
    assert later.take(1, torch.zeros(1, B, H)) == ("len", 2)
    later.give_back(0)
    assert later.take(2, torch.zeros(S, B, H)) is None  # a full-length activation was not captured here
    first = ChunkGraphs(_TinyGPT(pre_process=True), True, 1, shapes, masks, torch.device("cpu"), capture=capture)
    assert first.take(0, torch.zeros(B, S, dtype=torch.long)) == ("len", S)


class _TinyBERT(_TinyGPT):
    """BertModel's naming: its transformer block is ``encoder``."""

    def __init__(self, pre_process: bool) -> None:
        super().__init__(pre_process)
        self.encoder = self.decoder
        del self.decoder

    def set_input_tensor(self, tensors) -> None:
        self.encoder.set_input_tensor(tensors[0])

    def forward(self, input_ids, position_ids, attention_mask, labels=None, rotary_pos_emb=None):
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else None
        return self.encoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)


def test_bert_replays_its_encoder_and_matches_the_chunk() -> None:
    tokens, pos, mask = _batch()
    ref = _TinyBERT(pre_process=True)
    ref(tokens, pos, mask).square().sum().backward()
    chunk = _TinyBERT(pre_process=True)
    graphs = _graphs(chunk, first=True)
    assert graphs.decoder is chunk.encoder
    out = Replay(graphs, graphs.take(0, tokens), chunk)(tokens, pos, mask)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref(tokens, pos, mask))
    for name, grad in _grads(ref).items():
        torch.testing.assert_close(_grads(chunk)[name], grad)
    assert "forward" not in vars(chunk.encoder)


def test_a_varying_mask_is_copied_into_the_slots_buffer(monkeypatch) -> None:
    """BERT: each replay fills the slot's captured mask buffer with its microbatch's padding mask; GPT's
    pairs have no buffer (their captured mask is every microbatch's) and copy nothing."""
    from trainer.pipeline import cuda_graphs

    monkeypatch.setattr(cuda_graphs._Replayed, "apply", lambda x, pair: x)
    buffer = torch.zeros(B, 1, S, S, dtype=torch.bool)
    pair = cuda_graphs._GraphPair(None, None, None, None, None, None, mask=buffer)
    given = torch.rand(B, 1, S, S) < 0.5
    x = torch.zeros(S, B, H)
    assert cuda_graphs._PairReplay(pair)(x, given) is x
    assert torch.equal(buffer, given) and buffer.data_ptr() != given.data_ptr()
    with pytest.raises(RuntimeError, match=r"an attention mask of shape \(1, 1, 6, 6\), captured \(2, 1, 6, 6\)"):
        cuda_graphs._PairReplay(pair)(x, torch.ones(1, 1, S, S, dtype=torch.bool))
    gpt = cuda_graphs._GraphPair(None, None, None, None, None, None)
    assert cuda_graphs._PairReplay(gpt)(x, given) is x  # nothing to fill


class _FakeGraph:
    def __init__(self) -> None:
        self.registered = []

    def register_generator_state(self, state) -> None:
        self.registered.append(state)


def test_every_graph_registers_the_graph_safe_trackers_states(monkeypatch) -> None:
    """Dropout inside a graph draws from megatron's tracker states (the TP-region one included): each
    graph registers them all, so every replay advances them (fresh masks). Without the graph-safe
    tracker nothing is registered, and megatron's RNG save/restore is bypassed instead."""
    from megatron.core.tensor_parallel import random as tp_random

    from trainer.pipeline import graph_rng

    class Tracker:
        use_cudagraphable_rng = True

    states = {"model-parallel-rng": object(), "data-parallel-rng": object()}
    monkeypatch.setattr(tp_random, "get_cuda_rng_tracker", lambda: Tracker())
    monkeypatch.setattr(tp_random, "get_all_rng_states", lambda: states)
    graph = _FakeGraph()
    graph_rng.register_generators(graph)
    assert graph.registered == list(states.values())
    originals = (tp_random._get_all_rng_states, tp_random._set_all_rng_states, tp_random.CudaRNGStatesTracker.fork)
    with graph_rng.rng_state_bypassed():  # graph-safe: megatron's own save/restore stays
        assert (tp_random._get_all_rng_states, tp_random._set_all_rng_states,
                tp_random.CudaRNGStatesTracker.fork) == originals
    Tracker.use_cudagraphable_rng = False
    graph = _FakeGraph()
    graph_rng.register_generators(graph)
    assert graph.registered == []


def test_only_a_block_with_dropout_registers_generators() -> None:
    """A registered generator costs two kernels per replay, so graphs register them only where the
    block's TransformerConfig has dropout."""
    from types import SimpleNamespace

    from trainer.pipeline.graph_rng import draws_random

    def call(hidden, attention):
        return SimpleNamespace(decoder=SimpleNamespace(config=SimpleNamespace(hidden_dropout=hidden,
                                                                              attention_dropout=attention)))

    assert not draws_random(call(0.0, 0.0))
    assert draws_random(call(0.1, 0.0)) and draws_random(call(0.0, 0.1))
    assert not draws_random(SimpleNamespace(decoder=torch.nn.Linear(1, 1)))  # no config: nothing drawn
    # Transformer Engine's attention advances its generator's philox offset even at dropout 0 (a stand-in
    # class named and placed as TE's; megatron-core's TEDotProductAttention subclasses it).
    te_attention = type("DotProductAttention", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.attention"})
    megatron_te = type("TEDotProductAttention", (te_attention,), {"__module__": "megatron.core.extensions.te"})
    block = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sequential(megatron_te()))
    block.config = SimpleNamespace(hidden_dropout=0.0, attention_dropout=0.0)
    assert draws_random(SimpleNamespace(decoder=block))
    assert not draws_random(SimpleNamespace(decoder=torch.nn.Sequential(torch.nn.Linear(1, 1))))


def test_checkpoints_save_graph_safe_rng_states_as_tensors(monkeypatch) -> None:
    """With graphs the RNG tracker holds generator objects (graph-safe): a checkpoint stores their state
    tensors, and a tracker that is not graph-safe loads them as they are. (CUDA stand-ins: the CPU
    generator has the same get_state; the graph-safe direction needs CUDA.)"""
    from megatron.core import tensor_parallel

    from trainer.checkpoint import state as checkpoint

    class Tracker:
        use_cudagraphable_rng = False

        def __init__(self) -> None:
            self.states = {"model-parallel-rng": torch.Generator().manual_seed(7)}

        def get_states(self):
            return self.states

        def set_states(self, states) -> None:
            self.states = states

    tracker = Tracker()
    want = tracker.states["model-parallel-rng"].get_state()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: None)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    saved = checkpoint._rng_state()
    assert torch.equal(saved["rng_tracker_states"]["model-parallel-rng"], want)
    checkpoint._set_rng_state(saved)
    assert torch.equal(tracker.states["model-parallel-rng"], want)
