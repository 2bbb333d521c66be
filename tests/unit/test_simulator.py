"""The simulator, and the properties every schedule must show.

Costs are in units of one stage's forward. Figures asserted here are printed, with the commands
that produce them, in docs/schedules.md.
"""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from trainer.profiling.validate import validate_trace
from trainer.schedule import Action, Op, PipelineShape, make_policy
from trainer.schedule.compare import ScheduleSpec, compare, run_once
from trainer.schedule.costs import CostModel
from trainer.schedule.simulate import main as simulate_main
from trainer.schedule.simulator import DeadlockError, simulate
from trainer.schedule.trace import trace_events

UNIFORM = CostModel()  # F = I = W = 1: B = 2F
SEEDS = list(range(20))


def _dependencies_respected(result) -> None:
    """Every action ran once, after what it needs: F after the upstream F (+ that edge's
    transfer), B/I after this stage's F and the downstream B/I (+ transfer), W after I."""
    shape, edges = result.shape, result.edge_transfer
    end = {}
    for r in result.timeline:
        key = (r.stage, r.action)
        assert key not in end, f"{r.action} ran twice on stage {r.stage}"
        end[key] = r.end
    # Which stages split their backwards: zb-h1 every one; dpp-zb every one but stage 0 at v = 1
    # (DynamicOptions.split_first_stage: whole backwards there change nothing and cost memory).
    split = {s: any(r.action.op is Op.I for r in result.timeline if r.stage == s) for s in range(shape.num_stages)}
    wanted = {s: result.schedule == "zb-h1" or (result.schedule == "dpp-zb" and (s > 0 or shape.num_chunks > 1))
              for s in range(shape.num_stages)}
    assert split == wanted, (result.schedule, split)
    per_op = shape.num_microbatches * shape.num_chunks
    assert len(end) == sum((3 if split[s] else 2) * per_op for s in range(shape.num_stages))
    tol = 1e-9
    for r in result.timeline:
        a, s = r.action, r.stage
        m, c = a.microbatch, a.chunk
        if a.op is Op.F:
            up = shape.upstream(s, c)
            if up is not None:
                assert r.start >= end[(up[0], Action(Op.F, m, up[1]))] + edges[up[0]] - tol
        elif a.op in (Op.B, Op.I):
            assert r.start >= end[(s, Action(Op.F, m, c))] - tol
            down = shape.downstream(s, c)
            if down is not None:
                down_op = Op.I if split[down[0]] else Op.B
                assert r.start >= end[(down[0], Action(down_op, m, down[1]))] + edges[s] - tol
        else:
            assert r.start >= end[(s, Action(Op.I, m, c))] - tol


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved", 2),
                                    ("interleaved", 4), ("zb-h1", 1), ("dpp", 1), ("dpp", 3),
                                    ("dpp-zb", 1), ("dpp-zb", 2)])
def test_every_action_runs_once_in_dependency_order(name, v):
    costs = CostModel(jitter=0.5, seq_len_sigma=0.4, edge_transfer=(0.05, 0.4, 0.05, 0.2))
    m_count = 8 if name == "interleaved" else 7
    result = run_once(ScheduleSpec(name, v), 4, m_count, costs, seed=3, record=True)
    assert result.edge_transfer == [0.05, 0.4, 0.05, 0.2]
    _dependencies_respected(result)


def test_a_slow_edge_costs_time_but_never_breaks_dependencies():
    """Per-edge transfer: a slow middle edge (e.g. across nodes) delays the step by about twice
    its latency per pipeline fill/drain, and the trace's send events carry each edge's time."""
    fast = run_once(ScheduleSpec("1f1b"), 4, 8, UNIFORM, seed=0)
    slow_costs = CostModel(edge_transfer=(0.0, 0.5, 0.0, 0.0))
    slow = run_once(ScheduleSpec("1f1b"), 4, 8, slow_costs, seed=0, record=True)
    assert slow.step_time >= fast.step_time + 2 * 0.5 - 1e-9
    _dependencies_respected(slow)
    sends = [e for e in trace_events(slow) if e["cat"] == "send"]
    assert {e["dur"] for e in sends if e["pid"] == 1 and e["name"].startswith("send act")} == {500.0}
    assert {e["dur"] for e in sends if e["pid"] == 2 and e["name"].startswith("send grad")} == {500.0}
    assert {e["dur"] for e in sends if e["pid"] == 0} == {0.0}
    with pytest.raises(ValueError, match="edge_transfer has 2 entries, need one per edge: num_stages=4"):
        CostModel(edge_transfer=(0.1, 0.1)).draw(PipelineShape(4, 8), np.random.default_rng(0))


def _deadlock_sweep(names: list[str], draws: int, seed: int) -> int:
    """Simulate ``draws`` random (p, v, M, costs, options) per policy; return the runs done.
    simulate() raises DeadlockError on any stuck stage, and StageState asserts each action
    runs once and only when ready."""
    rng = np.random.default_rng(seed)
    runs = 0
    for name in names:
        done = 0
        while done < draws:
            p = int(rng.choice([2, 3, 4, 8]))
            v = int(rng.choice([1, 2, 4]))
            m_count = int(rng.integers(p, 8 * p + 1))
            if name in ("1f1b", "zb-h1"):
                v = 1
            if name == "interleaved":
                v = max(v, 2)
                m_count = p * max(1, m_count // p)  # Megatron's own precondition
            options = {}
            if name in ("dpp", "dpp-zb"):
                options = {"cap_factor": float(rng.choice([1.0, 1.25, 1.5, 1.75, 2.0, 3.0])),
                           "priority": str(rng.choice(["forward", "backward"])),
                           "chunk_order": str(rng.choice(["depth", "breadth"])),
                           "backward_chunk_order": str(rng.choice(["depth", "breadth"])),
                           "cap_basis": str(rng.choice(["stage", "peak"])),
                           "reserve_owed": bool(rng.choice([True, False])),
                           "microbatch_order": str(rng.choice(["cost", "index"]))}
                options["chunk_caps"] = str(rng.choice(["none", "interleaved"]))
                if name == "dpp-zb":
                    order = rng.choice(["oldest", "youngest", "default"])  # default: by v
                    if order != "default":
                        options["weight_order"] = str(order)
                    options["split_first_stage"] = bool(rng.choice([True, False]))
            elif name != "interleaved" or m_count % p == 0:
                options = {"microbatch_order": str(rng.choice(["cost", "index"]))}
            costs = CostModel(forward=float(rng.uniform(0.3, 2)), input_grad=float(rng.uniform(0.3, 2)),
                              weight_grad=float(rng.uniform(0.3, 2)),
                              # per-hop latency up to 2 forwards (the 4xH100 runtime's is ~1.7)
                              edge_transfer=tuple(rng.uniform(0, float(rng.choice([0.5, 2.0])), p).tolist()),
                              jitter=float(rng.uniform(0, 0.8)), seq_len_sigma=float(rng.uniform(0, 0.8)),
                              straggler_stage=int(rng.integers(p)), straggler_factor=float(rng.uniform(1, 2)),
                              stall_probability=float(rng.uniform(0, 0.1)),
                              stall_duration=float(rng.uniform(0, 5)))
            shape = PipelineShape(p, m_count, v)
            policies = [make_policy(name, shape, s, **options) for s in range(p)]
            result = simulate(shape, policies, costs.draw(shape, rng))
            if name in ("dpp", "dpp-zb"):
                assert all(peak <= pol.cap for peak, pol in zip(result.peak_inflight, policies, strict=True))
                for peaks, pol in zip(result.peak_inflight_per_chunk, policies, strict=True):
                    assert pol.chunk_caps is None or all(n <= c for n, c in zip(peaks, pol.chunk_caps, strict=True))
            done += 1
            runs += 1
    return runs


DEADLOCK_POLICIES = ["gpipe", "1f1b", "interleaved", "zb-h1", "dpp", "dpp-zb"]


def test_no_deadlock_over_100_random_draws_per_policy():
    """Every run of `make test`: the sweep below, a tenth as broad (another seed, so draws the slow
    tier's sweep does not repeat)."""
    assert _deadlock_sweep(DEADLOCK_POLICIES, draws=100, seed=2027) == 600


@pytest.mark.slow  # the breadth is the point: ~40 s on a 2-core machine; `make test-slow`
@pytest.mark.timeout(150)
def test_no_deadlock_over_1000_random_draws_per_policy():
    assert _deadlock_sweep(DEADLOCK_POLICIES, draws=1000, seed=2026) == 6000


# ---- per-hop latency (--hop-latency, CostModel.transfer) ------------------------------------------
def _closed_form_1f1b(p: int, m_count: int, latency: float) -> float:
    """1F1B on uniform costs (F = I = W = 1) with every message ``latency`` late, M = k p.

    Stage 0 holds p activations, so its forward of m + p waits for m's round trip: p - 1
    forwards down, p - 1 backwards (2 each) back up and 2 (p - 1) hops, then its own B(m) and
    F(m + p): 3p + 2(p - 1) L for every p microbatches. The cap divides the round trip: each
    microbatch pays 2(p - 1) L / p of idle time on every stage, not only in the fill and drain,
    which add 2(p - 2) L (p = 2, M = 2 by hand: stage 1 runs F0 B0 F1 B1 from 1 + L, stage 0's
    B0 starts at 4 + 2L, B1 at 7 + 2L: 9 + 2L)."""
    return 3 * (m_count + p - 1) + latency * (2 * (p - 1) * m_count / p + 2 * (p - 2))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("latency", [0.0, 0.1, 0.5, 1.5])
def test_hop_latency_1f1b_closed_form(p, latency):
    costs = CostModel(transfer=latency)
    steps = {}
    for k in (1, 2, 4):
        steps[k] = run_once(ScheduleSpec("1f1b"), p, k * p, costs, seed=0).step_time
        assert steps[k] == pytest.approx(_closed_form_1f1b(p, k * p, latency), abs=1e-9), k
    # one more round trip of stage 0 per p more microbatches
    assert steps[2] - steps[1] == pytest.approx(3 * p + 2 * (p - 1) * latency, abs=1e-9)


def test_hop_latency_zero_is_todays_model():
    """Latency 0 reproduces the figures of docs/schedules.md exactly (uniform row), and every
    draw is the same with transfer=0 given or not."""
    expected = {("1f1b", 1): 105.0, ("zb-h1", 1): 99.0, ("dpp", 1): 105.0, ("dpp-zb", 1): 99.0,
                ("interleaved", 2): 100.5, ("dpp", 2): 101.0, ("dpp-zb", 2): 98.0}
    for (name, v), step in expected.items():
        assert run_once(ScheduleSpec(name, v), 4, 32, CostModel(transfer=0.0), seed=0).step_time == step
        for varied in (dict(jitter=0.3), dict(seq_len_sigma=0.6), dict(stall_probability=0.05, stall_duration=2)):
            assert (run_once(ScheduleSpec(name, v), 4, 16, CostModel(transfer=0.0, **varied), seed=4).step_time
                    == run_once(ScheduleSpec(name, v), 4, 16, CostModel(**varied), seed=4).step_time)


@pytest.mark.parametrize("latency", [0.5, 1.0, 1.5])
def test_cap_headroom_hides_hop_latency(latency):
    """The 4xH100 finding (docs/benchmarks.md, third session): at 1F1B's caps dpp pays the round
    trip on every microbatch exactly as 1F1B does; with headroom it does not. A stage's cap
    must hold at least (p - s) + 2(p - s - 1) L / (F + B) activations to cover its round trip;
    with 2x (8/6/4/2 at p=4) only the fill and drain pay the latency (2 (p - 1) hops)."""
    p, m_count, costs = 4, 32, CostModel(transfer=latency)
    step = {f: run_once(ScheduleSpec("dpp", 1, {"cap_factor": f}), p, m_count, costs, seed=0).step_time
            for f in (1.0, 1.25, 1.5, 2.0)}
    assert step[1.0] == pytest.approx(_closed_form_1f1b(p, m_count, latency))
    assert step[1.0] > step[1.25] > step[1.5] > step[2.0]
    assert step[2.0] == pytest.approx(3 * (m_count + p - 1) + 2 * (p - 1) * latency)
    # 1.25x leaves stage 1 at 3 < 3 + 4L/3: it stays latency-bound, >= M (3*3 + 4L) / 3 apart
    assert step[1.25] >= m_count * (9 + 4 * latency) / 3


def test_cli_hop_latency_flag(capsys):
    assert simulate_main(["--pp", "4", "--vp", "1", "--microbatches", "32", "--schedules", "dpp",
                          "--hop-latency", "1", "--cap-factor", "2"]) == 0
    out = capsys.readouterr().out
    assert "median step 157.00" in out and "\ndpp " in out and "111.00" in out


def test_cli_held_caps_set_each_stage_s_cap_as_a_fitted_held_cap_does(capsys):
    """--dpp-held-cap fit keeps 4/3/3/2 slots on BERT at PP=4 (docs/bench/2026-11-29-held-cap-fit-1xH200.md):
    on uniform costs that sits between the peak bound (4 on every stage) and each stage's own."""
    steps = {}
    for caps in (None, "4,3,3,2", "4,3,2,1"):
        extra = [] if caps is None else ["--held-caps", caps]
        assert simulate_main(["--pp", "4", "--vp", "1", "--microbatches", "32", "--schedules", "dpp-zb",
                              "--cap-basis", "peak", *extra]) == 0
        row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dpp-zb"))
        steps[caps] = (float(row.split()[2]), row.split()[-1])
    assert steps == {None: (99.0, "4,4/3,4/2,4/1"), "4,3,3,2": (101.0, "4,3/3,3/2,2/1"),
                     "4,3,2,1": (102.0, "4,3/3,2/2,1/1")}
    with pytest.raises(SystemExit):
        simulate_main(["--pp", "4", "--held-caps", "4,3"])
    assert "one cap >= 1 per stage (--pp 4)" in capsys.readouterr().err


def test_deadlock_is_reported_not_returned():
    """A policy that refuses everything is named, with what the stage was refusing."""
    shape = PipelineShape(2, 2)

    class Stubborn:
        name, split_backward = "stubborn", False

        def choose(self, state):
            return None

        def __repr__(self):
            return "Stubborn()"

    with pytest.raises(DeadlockError, match=r"stage 0 \(Stubborn\(\)\): 0/4 done.*F0.c0"):
        simulate(shape, [Stubborn(), Stubborn()], UNIFORM.draw(shape, np.random.default_rng(0)))


@pytest.mark.parametrize("p,m_count", [(2, 2), (4, 8), (4, 32), (8, 13)])
def test_uniform_1f1b_bubble_is_textbook(p, m_count):
    result = run_once(ScheduleSpec("1f1b"), p, m_count, UNIFORM, seed=0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m_count + p - 1), abs=1e-12)
    assert result.peak_inflight == [min(p - s, m_count) for s in range(p)]


@pytest.mark.parametrize("p,m_count,v", [(2, 4, 2), (4, 8, 2), (4, 32, 2), (4, 16, 4), (3, 9, 3)])
def test_uniform_interleaved_bubble_matches_formula(p, m_count, v):
    """Megatron's interleaved 1F1B: bubble (p-1)/(v*M + p-1), i.e. (1/v) of 1F1B's idle time."""
    result = run_once(ScheduleSpec("interleaved", v), p, m_count, UNIFORM, seed=0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m_count + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m_count", [(4, 8), (4, 32), (8, 24)])
def test_zero_bubble_schedules_cut_1f1b_bubble_to_a_third(p, m_count):
    """ZB-H1 (and dpp-zb with 1F1B's per-GPU activation memory) idle (p-1)(F+I-W) per stage = 1/3 of
    1F1B's (p-1)(F+B) when F = I = W (the bubble as idle time, as the ZB paper counts it)."""
    one_f_one_b = run_once(ScheduleSpec("1f1b"), p, m_count, UNIFORM, seed=0)
    for name in ("zb-h1", "dpp-zb"):
        result = run_once(ScheduleSpec(name), p, m_count, UNIFORM, seed=0)
        idle = result.step_time * p - sum(result.busy)
        base_idle = one_f_one_b.step_time * p - sum(one_f_one_b.busy)
        assert idle <= base_idle / 3 + 1e-9, name
        assert max(result.peak_inflight) <= p  # 1F1B's per-GPU peak


@pytest.mark.parametrize("p,m_count,v", [(4, 32, 1), (4, 32, 2), (4, 8, 1), (8, 32, 1), (3, 10, 2)])
def test_dpp_never_more_than_1pct_slower_than_1f1b_on_uniform_costs(p, m_count, v):
    base = run_once(ScheduleSpec("1f1b"), p, m_count, UNIFORM, seed=0).step_time
    for name in ("dpp", "dpp-zb"):
        step = run_once(ScheduleSpec(name, v), p, m_count, UNIFORM, seed=0).step_time
        assert step <= 1.01 * base, (name, step, base)


VARIATION = {
    "jitter 30%": CostModel(jitter=0.3),
    "log-normal lengths": CostModel(seq_len_sigma=0.5),
}
GAINS = [  # (schedule, v, options, the cap it runs with)
    ("dpp", 2, {"cap_factor": 1.5}),  # 1.5 x Megatron's interleaved bound
    ("dpp-zb", 1, {}),  # held <= p (1F1B's per-GPU peak), live <= p - s
]


@pytest.mark.parametrize("variation", sorted(VARIATION))
def test_dpp_beats_1f1b_by_10pct_under_variation(variation):
    specs = [ScheduleSpec(name, v, options) for name, v, options in GAINS]
    _, rows = compare(specs, 4, 32, VARIATION[variation], SEEDS)
    for row in rows:
        assert row.speedup >= 1.10, (variation, row.spec, row.speedup)


def test_dpp_peak_never_exceeds_cap_under_variation():
    for cap in (2, 3, 5):
        result = run_once(ScheduleSpec("dpp", 2, {"max_inflight": cap * 2}), 4, 16,
                          CostModel(jitter=0.6, seq_len_sigma=0.6), seed=cap)
        assert max(result.peak_inflight) <= cap * 2
        result = run_once(ScheduleSpec("dpp", 1, {"max_inflight": cap}), 4, 16,
                          CostModel(jitter=0.6), seed=cap)
        assert max(result.peak_inflight) == cap  # the cap binds on stage 0, and is respected


def test_same_seed_same_workload_across_chunk_counts():
    """Sequence lengths are drawn first, so v=1 and v=2 schedules see the same microbatches."""
    costs = CostModel(seq_len_sigma=0.5)
    one = costs.draw(PipelineShape(2, 6, 1), np.random.default_rng(5))
    two = costs.draw(PipelineShape(2, 6, 2), np.random.default_rng(5))
    per_mb_one = np.array(one.durations[Op.F]).sum(axis=(0, 1))
    per_mb_two = np.array(two.durations[Op.F]).sum(axis=(0, 1))
    assert np.allclose(per_mb_one, per_mb_two)
    assert statistics.pstdev(per_mb_one.tolist()) > 0.05


def test_cost_model_names_every_bad_value():
    with pytest.raises(ValueError, match="forward=0.*jitter=-1.*attention_fraction=2"):
        CostModel(forward=0, jitter=-1, attention_fraction=2)


def test_cli_prints_table_and_writes_valid_traces(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert simulate_main(["--pp", "4", "--vp", "2", "--microbatches", "8", "--jitter", "0.3",
                          "--seeds", "3", "--trace", str(out)]) == 0
    table = capsys.readouterr().out
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "dpp", "dpp-zb"):
        assert f"\n{name} " in table
        document = json.loads((tmp_path / f"sim.{name}.json").read_text())
        assert document["metadata"]["source"] == "simulator" and document["metadata"]["schedule"] == name
        assert validate_trace(document) == [], name
    assert "11/11,11/9,11/7,11/5" in table  # dpp-zb v=2 caps are printed


def test_cli_cap_sweep_and_bad_flags(capsys):
    assert simulate_main(["--pp", "3", "--microbatches", "6", "--cap-sweep", "1,2", "--sweep-vp", "1",
                          "--schedules", "dpp", "--jitter", "0.3", "--seeds", "2"]) == 0
    assert "2x cap" in capsys.readouterr().out
    for bad in (["--schedules", "zb-h3"], ["--straggler", "9:1.2"], ["--seq-len-dist", "gamma:1"],
                ["--vp", "1", "--schedules", "interleaved"], ["--jitter", "-0.1"]):
        with pytest.raises(SystemExit) as exit_info:
            simulate_main(bad)
        assert exit_info.value.code == 2


# ---- the default dynamic policy against the best static schedules ---------------------------------
# Every variability scenario of docs/schedules.md's table, 20 seeds each: a few
# seconds of CPU in all.
VARIABILITY = {
    **{f"lengths {sigma}": CostModel(seq_len_sigma=sigma) for sigma in (0.4, 0.6, 0.8)},
    **{f"jitter {pct}%": CostModel(jitter=pct / 100) for pct in (10, 20, 30, 40)},
    **{f"stalls {pct}% x {d}": CostModel(stall_probability=pct / 100, stall_duration=d)
       for pct, d in ((2, 4), (5, 2), (1, 8))},
}


@pytest.mark.parametrize("scenario", sorted(VARIABILITY))
def test_dpp_zb_beats_zb_h1_at_1f1b_memory(scenario):
    """At 1F1B's per-GPU activation memory (peak p), default dpp-zb's median step is no longer
    than static ZB-H1's and >= 5% faster than 1F1B (the full table: docs/schedules.md)."""
    base, (zb, dyn) = compare([ScheduleSpec("zb-h1"), ScheduleSpec("dpp-zb")], 4, 32, VARIABILITY[scenario], SEEDS)
    assert dyn.step_time <= zb.step_time, (scenario, dyn.step_time, zb.step_time)
    assert base.step_time / dyn.step_time >= 1.05 and dyn.peak_activations <= 4
    uniform = [run_once(ScheduleSpec(n), 4, 32, UNIFORM, seed=0).step_time for n in ("zb-h1", "dpp-zb")]
    assert uniform[1] <= 1.01 * uniform[0]


@pytest.mark.parametrize("scenario", sorted(VARIABILITY))
def test_dpp_zb_v2_beats_megatron_interleaved_at_its_memory(scenario):
    _, (inter, dyn) = compare([ScheduleSpec("interleaved", 2), ScheduleSpec("dpp-zb", 2)], 4, 32,
                              VARIABILITY[scenario], SEEDS)
    assert dyn.step_time <= inter.step_time and dyn.peak_activations <= inter.peak_activations


def test_cost_order_is_what_buys_the_lengths_gain():
    """Same policy, same draws: the length-based microbatch order is worth > 10 points, and the
    hints never change a run without lengths (all alike: index order)."""
    costs = CostModel(seq_len_sigma=0.6)
    _, (cost, index) = compare([ScheduleSpec("dpp-zb"), ScheduleSpec("dpp-zb", 1, {"microbatch_order": "index"})],
                               4, 32, costs, SEEDS[:10])
    assert cost.speedup > index.speedup + 0.10
    jitter = [run_once(ScheduleSpec("dpp-zb", 1, {"microbatch_order": o}), 4, 16, CostModel(jitter=0.3), 1).step_time
              for o in ("cost", "index")]
    assert jitter[0] == jitter[1]


def test_stalls_are_per_stage_op_whatever_v_and_leave_other_draws_alone():
    shape1, shape2 = PipelineShape(4, 32, 1), PipelineShape(4, 32, 2)
    stalls = CostModel(stall_probability=0.05, stall_duration=2)
    extra = [np.array(stalls.draw(sh, np.random.default_rng(0)).durations[Op.F]).sum() - 4 * 32
             for sh in (shape1, shape2) for _ in range(1)]
    assert 0 < extra[0] < 40 and 0 < extra[1] < 40
    plain = CostModel(jitter=0.2).draw(shape1, np.random.default_rng(3)).durations[Op.F]
    stalled = CostModel(jitter=0.2, stall_probability=0.5, stall_duration=1).draw(
        shape1, np.random.default_rng(3)).durations[Op.F]
    diff = np.array(stalled) - np.array(plain)
    assert set(np.round(diff, 9).ravel().tolist()) == {0.0, 1.0}
    with pytest.raises(ValueError, match="stall_probability=2.*stall_duration=-1.*stage_scale"):
        CostModel(stall_probability=2, stall_duration=-1, stage_scale=(1.0, 0.0))


def test_stalls_narrowed_to_one_stages_forwards_are_the_same_draws(capsys):
    """The benchmark's scenario (c) delays rank 1's forwards only: --stalls 0.05:20:1:F. A seed's stalls
    narrow to that stage and op; every other op is as without stalls."""
    shape = PipelineShape(4, 32, 1)
    every = CostModel(stall_probability=0.3, stall_duration=1).draw(shape, np.random.default_rng(5))
    one = CostModel(stall_probability=0.3, stall_duration=1, stall_stage=1, stall_ops="F").draw(
        shape, np.random.default_rng(5))
    for op in (Op.F, Op.I, Op.W):
        narrowed, all_stages = np.array(one.durations[op]), np.array(every.durations[op])
        if op is Op.F:
            assert (narrowed[1] == all_stages[1]).all() and narrowed[1].max() == 2.0
            assert (np.delete(narrowed, 1, axis=0) == 1.0).all()
        else:
            assert (narrowed == 1.0).all() and all_stages.max() == 2.0
    for bad in (dict(stall_stage=-1), dict(stall_ops="FX"), dict(stall_ops="")):
        with pytest.raises(ValueError, match="stall_"):
            CostModel(**bad)
    with pytest.raises(ValueError, match="stall_stage=4 outside"):
        CostModel(stall_probability=0.1, stall_duration=1, stall_stage=4).draw(shape, np.random.default_rng(0))
    args = ["--pp", "4", "--vp", "1", "--microbatches", "8", "--seeds", "2", "--schedules", "zb-h1"]
    assert simulate_main([*args, "--stalls", "0.5:3:1:F"]) == 0
    assert simulate_main([*args, "--stalls", "0.5:3:1:FW"]) == 0
    for bad in ("0.5", "0.5:3:x", "0.5:3:1:F:9", "0.5:3:1:Q"):
        with pytest.raises(SystemExit):
            simulate_main([*args, "--stalls", bad])


def test_balanced_layer_split_fixes_a_heavy_last_stage():
    from trainer.schedule.layers import LayerCosts, balanced_split, split_of

    costs = LayerCosts(16, layer=1.0, embedding=0.2, head=2.0)
    even = split_of(costs, [4, 4, 4, 4])
    best = balanced_split(costs, 4)
    assert even.bottleneck == 6.0 and best.layers == (4, 5, 5, 2) and best.bottleneck == 5.0
    assert best.flags() == ["--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "2"]
    assert balanced_split(LayerCosts(16), 4).flags() == []  # nothing to fix: the even split, no flags
    slow = LayerCosts(24, stage_speed=(1.0, 1.3, 1.0, 1.0))
    free = balanced_split(slow, 4, megatron_flags=False)
    assert free.bottleneck == 7.0 and free.layers[1] == 5 and sum(free.layers) == 24
    assert balanced_split(LayerCosts(32, head=2.0), 4, num_chunks=2).layers[-1] % 2 == 0
    with pytest.raises(ValueError, match="num_layers=0 must be >= 1; layer=-1"):
        LayerCosts(0, layer=-1)
    with pytest.raises(ValueError, match="num_layers=3 < num_stages"):
        balanced_split(LayerCosts(3), 4)


def test_cli_resplit_and_stalls(capsys):
    assert simulate_main(["--pp", "4", "--vp", "1", "--microbatches", "16", "--seeds", "2", "--schedules",
                          "zb-h1,dpp-zb", "--layers", "16", "--head-cost", "2", "--embedding-cost", "0.2",
                          "--resplit", "--stalls", "0.02:4"]) == 0
    out = capsys.readouterr().out
    assert "layer split: 4/4/4/4 layers" in out and "re-split: 4/5/5/2 layers" in out
    assert "--decoder-last-pipeline-num-layers 2" in out
    for bad in (["--resplit"], ["--layers", "16", "--split", "4,4,4"], ["--stalls", "x"]):
        with pytest.raises(SystemExit):
            simulate_main(bad)


# The 4xH200 benchmark's costs (GPT 16 layers h2048, M=32; docs/schedules.md, "The step against its
# balanced limit"): ms per microbatch of a layer, the embedding and the head with loss, as (F, I, W).
H200_OPS = dict(layer=(0.731, 1.081, 0.555), embedding=(0.166, 0.0, 0.331), head=(1.276, 1.276, 1.276))


def _measured(split, schedules, **options):
    from trainer.schedule.layers import LayerOps

    ops = LayerOps(16, **H200_OPS).stage_ops(split)
    costs = CostModel(stage_ops=ops)
    _, rows = compare([ScheduleSpec(n, 1, options if n == "dpp-zb" else {}) for n in schedules],
                      len(split), 32, costs, [0])
    return ops, {r.spec.name: r for r in rows}


def test_measured_costs_dpp_zb_reaches_the_zero_bubble_bound_at_1f1b_memory():
    """On the benchmark's 5/4/4/3 split stage 0 is the slowest: no order at 1F1B's memory (stage 0
    holds p) ends before stage 0's busy time plus the wait for microbatch 0's round trip that its p
    forwards do not cover. dpp-zb must reach that bound (a policy that regressed would not) and so
    be >= 1.028x 1F1B at the same peak of held activations."""
    ops, rows = _measured((5, 4, 4, 3), ("1f1b", "zb-h1", "dpp-zb"))
    p, m = 4, 32
    stage0_busy = m * sum(ops[0])
    round_trip = ops[0][0] + sum(f + i for f, i, _ in ops[1:])  # W deferred on the later stages
    bound = stage0_busy + max(0.0, round_trip - p * ops[0][0])
    assert bound == pytest.approx(405.6, abs=0.1)
    for name in ("zb-h1", "dpp-zb"):
        assert rows[name].step_time >= bound - 1e-6
    assert rows["dpp-zb"].step_time == pytest.approx(bound, rel=1e-4)
    assert rows["1f1b"].step_time / rows["dpp-zb"].step_time >= 1.028
    assert rows["dpp-zb"].peak_activations == rows["1f1b"].peak_activations == p


def test_measured_costs_no_whole_layer_split_reaches_112_percent_of_the_balanced_limit():
    """The limit is sum(stage busy) / p; 1.12 x it is less than a stage of 5 plain layers, and 16
    layers on 4 stages need one (or a heavier first/last stage). More memory only removes the
    fill: at 2x the cap dpp-zb's step is stage 0's busy time exactly, still 1.169x."""
    from trainer.schedule.layers import LayerOps, balanced_split

    layer_ops = LayerOps(16, **H200_OPS)
    limit = 32 * sum(map(sum, layer_ops.stage_ops((4, 4, 4, 4)))) / 4
    for flags in (True, False):
        split = balanced_split(layer_ops.costs(), 4, megatron_flags=flags)
        assert 32 * split.bottleneck / limit > 1.12
    ops, rows = _measured((5, 4, 4, 3), ("dpp-zb",), cap_factor=2.0)
    assert rows["dpp-zb"].step_time == pytest.approx(32 * sum(ops[0]), rel=1e-6)
    assert rows["dpp-zb"].step_time / limit == pytest.approx(1.169, abs=0.001)


def test_stage_ops_and_cli_layer_ops(capsys):
    table = CostModel(stage_ops=((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))).draw(PipelineShape(2, 3), np.random.default_rng(0))
    assert table.durations[Op.I][1][0] == [5.0] * 3 and table.durations[Op.B][0][0] == [5.0] * 3
    with pytest.raises(ValueError, match="stage_ops=.*not three finite numbers"):
        CostModel(stage_ops=((1.0, 0.0, 1.0),))
    # One entry per virtual stage (model order: chunk c of stage s at c * p + s), each its chunk's own times;
    # a one-chunk schedule (the 1F1B baseline) runs a stage's chunks summed.
    chunks = CostModel(stage_ops=((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), (3.0, 3.0, 3.0), (4.0, 4.0, 4.0)))
    table = chunks.draw(PipelineShape(2, 3, 2), np.random.default_rng(0))
    assert [[table.durations[Op.F][s][c][0] for c in range(2)] for s in range(2)] == [[1.0, 3.0], [2.0, 4.0]]
    one = chunks.draw(PipelineShape(2, 3), np.random.default_rng(0))
    assert [one.durations[Op.W][s][0][0] for s in range(2)] == [4.0, 6.0]
    with pytest.raises(ValueError, match="stage_ops has 4 entries, need one per stage .* or one per virtual stage"):
        chunks.draw(PipelineShape(2, 3, 3), np.random.default_rng(0))
    args = ["--pp", "4", "--vp", "1", "--microbatches", "32", "--schedules", "1f1b,dpp-zb", "--layers", "16",
            "--layer-ops", "0.731:1.081:0.555", "--embedding-ops", "0.166:0:0.331", "--head-ops", "1.276:1.276:1.276"]
    assert simulate_main([*args, "--split", "5,4,4,3", "--resplit"]) == 0
    out = capsys.readouterr().out
    assert "stage costs 12.33, 9.47, 9.47, 10.93" in out and "re-split: 4/5/5/2 layers" in out
    assert "1f1b          1    417.36" in out and "dpp-zb        1    405.65" in out
    for bad in (args[:-6] + ["--head-ops", "1:1:1"], args[:10] + ["--layer-ops", "1:1"],
                args[:10] + ["--layer-ops", "0:1:1"], args[:8] + ["--layer-ops", "1:1:1"]):
        with pytest.raises(SystemExit):
            simulate_main(bad)


# Where every stage, or a middle one, is the bottleneck the drain's input gradients are the critical
# path; dpp-zb must not delay them with a deferred W (DynamicOptions.drain_lag) and so matches ZB-H1.
# (id, p, M, (I, W) of balanced stages with F = 1, or a layer split replaying the 4xH200 op costs)
BOTTLENECKS = [
    *[(f"balanced-I{i}-W{w}-p{p}-M{m}", p, m, (i, w))
      for i, w, shapes in ((1.5, 0.75, ((3, 12), (4, 16), (4, 32), (6, 24), (8, 32))),
                           (1.25, 0.75, ((4, 64), (8, 64))))
      for p, m in shapes],
    *[(f"H200-{'/'.join(map(str, split))}-M{m}", len(split), m, split)
      for split in ((4, 5, 5, 2), (3, 5, 5, 3)) for m in (16, 32, 64)],
]


@pytest.mark.parametrize("case", BOTTLENECKS, ids=[c[0] for c in BOTTLENECKS])
def test_dpp_zb_no_slower_than_zb_h1_when_a_middle_or_every_stage_is_the_bottleneck(case):
    from trainer.schedule.layers import LayerOps

    _, p, m, shape = case
    if len(shape) == 2:
        costs = CostModel(input_grad=shape[0], weight_grad=shape[1])
    else:
        costs = CostModel(stage_ops=LayerOps(sum(shape), **H200_OPS).stage_ops(shape))
    steps = {name: run_once(ScheduleSpec(name), p, m, costs, seed=0).step_time for name in ("1f1b", "dpp", "zb-h1", "dpp-zb")}
    assert steps["dpp-zb"] <= steps["zb-h1"] + 1e-6 and steps["dpp-zb"] < min(steps["1f1b"], steps["dpp"]), steps
    assert run_once(ScheduleSpec("dpp-zb"), p, m, costs, seed=0).peak_activations <= p  # ZB-H1's memory
    # The drain's filling is what lost: with every deferred W allowed to fill there, dpp-zb trails ZB-H1.
    old = run_once(ScheduleSpec("dpp-zb", 1, {"drain_lag": False}), p, m, costs, seed=0).step_time
    assert old > steps["zb-h1"] + 1e-3, (old, steps)


def test_cli_drain_lag_flag(capsys):
    args = ["--pp", "4", "--vp", "1", "--microbatches", "32", "--schedules", "zb-h1,dpp-zb", "--layers", "16",
            "--layer-ops", "0.731:1.081:0.555", "--embedding-ops", "0.166:0:0.331", "--head-ops", "1.276:1.276:1.276",
            "--split", "4,5,5,2"]
    assert simulate_main(args) == 0 and simulate_main([*args, "--drain-lag", "no"]) == 0
    out = capsys.readouterr().out
    assert out.count("zb-h1         1    391.94") == 2 and "dpp-zb        1    391.94" in out
    assert "dpp-zb        1    393.84" in out  # the greedy drain, a W before a critical input gradient


def test_cli_chunk_caps_hold_each_chunk_to_the_interleaved_order_s_count(capsys):
    """--chunk-caps interleaved: dpp-zb at v=2 with each chunk held to the interleaved order's count (its CUDA
    graph slots) on the benchmark model's chunk split (4xH200 op costs): 360.05 against the unbounded
    chunks' 357.72 and interleaved's 369.04 (docs/schedules.md)."""
    args = ["--pp", "4", "--vp", "2", "--microbatches", "32", "--schedules", "interleaved,dpp-zb", "--layers", "16",
            "--layer-ops", "0.731:1.081:0.555", "--embedding-ops", "0.166:0:0.331", "--head-ops", "1.276:1.276:1.276",
            "--attention-share", "0.721:0.662:0.662", "--split", "2,1.5,2,2,2.5,2.5,2.5,1"]
    assert simulate_main(args) == 0 and simulate_main([*args, "--chunk-caps", "interleaved"]) == 0
    out = capsys.readouterr().out
    assert out.count("interleaved   2    369.04") == 2 and "dpp-zb        2    357.72" in out
    assert "dpp-zb        2    360.05" in out and "11/11[8+4],11/9[8+4],11/7[8+4],11/5[8+4]" in out


def test_host_time_model_at_v2_dpp_zb_level_with_interleaved_once_it_looks_at_landed_activations(capsys):
    """The host-time simulator with the runtime's graphed settings (one op queued ahead, landing-aware dpp-zb)
    on the benchmark model's half splits. Deciding on gradients' landing alone (--land-forwards no, the runtime
    measured on 2xH200) it gives the ratios measured at PP=2 (dpp-zb v=2 0.980x the interleaved order, measured
    0.983x; dpp v=2 0.998x, measured 0.996x), and at PP=4 dpp-zb v=2 falls far behind at one queued op; looking
    at the activations' landing too (the default at v > 1) it is ahead of the interleaved order at PP=2 and PP=4,
    at one queued op and unbounded (docs/schedules.md)."""
    common = ["--microbatches", "32", "--layers", "16", "--layer-ops", "0.731:1.081:0.555", "--embedding-ops",
              "0.166:0:0.331", "--head-ops", "1.276:1.276:1.276", "--attention-share", "0.721:0.662:0.662",
              "--vp", "2", "--schedules", "interleaved,dpp,dpp-zb", "--chunk-caps", "interleaved", "--host-ahead",
              "--launch-cost", "0.05", "--header-latency", "0.05", "--hop-latency", "0.1", "--data-aware"]
    pp2 = [*common, "--pp", "2", "--split", "4.5,4.5,4,3", "--max-queued-ops", "1"]
    assert simulate_main([*pp2, "--land-forwards", "no"]) == 0
    out = capsys.readouterr().out
    assert "interleaved   2    690.10" in out and "dpp           2    691.35" in out and "dpp-zb        2    704.01" in out
    assert simulate_main(pp2) == 0
    out = capsys.readouterr().out
    assert "dpp           2    691.35" in out and "dpp-zb        2    687.32" in out  # dpp: off by default
    pp4 = [*common, "--pp", "4", "--split", "2,1.5,2,2,2.5,2.5,2.5,1"]
    assert simulate_main([*pp4, "--max-queued-ops", "1", "--land-forwards", "no"]) == 0
    out = capsys.readouterr().out
    assert "interleaved   2    369.69" in out and "dpp-zb        2    477.70" in out
    assert simulate_main([*pp4, "--max-queued-ops", "1"]) == 0 and simulate_main([*pp4, "--max-queued-ops", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("interleaved   2    369.69") == 2
    assert "dpp-zb        2    362.20" in out and "dpp-zb        2    371.09" in out
