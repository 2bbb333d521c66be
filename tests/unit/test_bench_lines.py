"""trainer.bench.lines: balanced split, the planned command lines, and lines that cannot run named with the reason."""

from __future__ import annotations

from pathlib import Path

from trainer.bench.lines import (
    BenchConfig,
    Line,
    NotRun,
    balanced_split,
    line_entry,
    plan,
    variable_length_args,
    variable_length_tokens,
)
from trainer.config import parse_config


def test_balanced_split_moves_layers_off_the_head_stage() -> None:
    assert balanced_split(16, 4, 1, 2.0) == (5, 3)  # the benchmark model's split measured best on 4 x H200
    assert balanced_split(16, 4, 2, 2.0) is None  # with v=2 no valid split beats even
    assert balanced_split(16, 4, 1, 0.0) is None
    assert balanced_split(8, 1, 1, 2.0) is None


def test_plan_gives_every_line_the_same_model_and_names_what_cannot_run() -> None:
    cfg = BenchConfig()
    planned = plan(cfg, ["megatron-1f1b-default", "megatron-1f1b-best", "dpp-zb", "direct-megatron"],
                   ["a", "b", "c"], available_policies=("dpp",))
    lines = [p for p in planned if isinstance(p, Line)]
    skipped = {(p.scenario, p.name): p.reason for p in planned if isinstance(p, NotRun)}
    assert "no --dpp-policy dpp-zb" in skipped[("a", "dpp-zb")] and ("b", "dpp-zb") in skipped
    assert [ln.key for ln in lines] == ["a-megatron-1f1b-default", "a-megatron-1f1b-best", "a-direct-megatron",
                                        "b-megatron-1f1b-default", "b-megatron-1f1b-best", "b-direct-megatron",
                                        "c-megatron-1f1b-default", "c-megatron-1f1b-best", "c-direct-megatron"]
    # scenario (b): every line, direct megatron-core included, on the same variable-length mock documents
    assert all(ln.args[-len(variable_length_args(cfg)) - 2:-2] == variable_length_args(cfg)
               for ln in lines if ln.scenario == "b")
    assert not any("--variable-seq-lengths" in ln.args for ln in lines if ln.scenario != "b")
    best = next(ln for ln in lines if ln.key == "a-megatron-1f1b-best")
    assert best.split == (5, 3) and "--no-batch-p2p-sync" in best.args
    assert next(ln for ln in lines if ln.key == "a-megatron-1f1b-default").split is None
    assert all("--inject-stalls" in ln.args for ln in lines if ln.scenario == "c")
    for line in lines:  # every trainer line is a valid trainer configuration on PP ranks
        if line.module == "trainer.train":
            parse_config(line.args, world_size=cfg.pipeline_parallel)


def test_queued_suffix_derives_a_bounded_variant_of_any_dpp_line_only() -> None:
    what, vp, flags, balanced = line_entry("dpp-graphs-rc-cf1.5-q3")
    assert flags[-2:] == ["--dpp-max-queued-ops", "3"] and "--recompute-activations" in flags
    assert vp == 1 and balanced and what.endswith("--dpp-max-queued-ops 3")
    assert line_entry("dpp-graphs-v2-q1")[1] == 2
    assert line_entry("dpp-graphs-q0")[2][-2:] == ["--dpp-max-queued-ops", "0"]  # unbounded
    for bad in ("megatron-1f1b-best-q2", "dpp-graphs-q01", "dpp-graphs-q2-q2", "nope-q2", "dpp-graphs-qx"):
        assert line_entry(bad) is None, bad
    line = next(p for p in plan(BenchConfig(), ["dpp-zb-q2"], ["a"], ("dpp", "dpp-zb")) if isinstance(p, Line))
    cfg = parse_config(line.args, world_size=4)
    assert cfg.parallel.dpp_max_queued_ops == 2


def test_variable_length_tokens_count_real_and_bucketed_tokens() -> None:
    cfg = BenchConfig(train_iters=3)
    real, padded = variable_length_tokens(cfg)
    full = cfg.global_batch_size * cfg.seq_length
    assert 0.3 * full < real < padded < 0.9 * full  # lognormal:0.6 around seq/2, rounded up to 64
    assert variable_length_tokens(cfg) == (real, padded)


def test_cpu_plan_labels_stand_ins_and_refuses_the_direct_line() -> None:
    cfg = BenchConfig(device="cpu", num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      pipeline_parallel=2, num_microbatches=4)
    planned = plan(cfg, ["megatron-interleaved-v2", "direct-megatron"], ["a"], ("dpp", "dpp-zb"))
    assert isinstance(planned[1], NotRun) and "runs on CUDA only" in planned[1].reason
    assert planned[0].label.startswith("CPU stand-in: our runtime's static interleaved policy")


def test_nothing_in_trainer_imports_the_benchmark() -> None:
    """The bench sits on top of the trainer: the import graph stays a tree."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "trainer"
    offenders = [str(p) for p in root.rglob("*.py") if "bench" not in p.relative_to(root).parts[:1]
                 and any(s in p.read_text() for s in ("import trainer.bench", "from trainer.bench",
                                                       "from trainer import bench"))]
    assert offenders == []


def test_report_pairs_rounds_so_host_drift_between_rounds_cancels(tmp_path) -> None:
    from trainer.bench.lines import BenchConfig
    from trainer.bench.report import write_report
    from trainer.bench.results import LineResult

    # Round 2 ran on a host 25% slower: pooled medians mix both, the per-round ratios do not.
    meg = LineResult("a-megatron-1f1b-best", "megatron-1f1b-best", "a", "m", timed_ms=[500, 500, 625, 625],
                     round_medians=[500.0, 625.0])
    dpp = LineResult("a-dpp", "dpp", "a", "d", timed_ms=[450, 450, 568, 568], round_medians=[450.0, 568.0])
    report = tmp_path / "r.md"
    write_report(report, BenchConfig(device="cpu"), [meg, dpp], [], {}, {}, 1.0)
    text = report.read_text()
    assert "| 1 | 500.0 | 450.0 (1.111x) |" in text
    assert "| 2 | 625.0 | 568.0 (1.100x) |" in text
    assert "per-round ratios 1.100–1.111x, median 1.106x" in text
    # A single round: no per-round table.
    write_report(report, BenchConfig(device="cpu"), [LineResult("a-dpp", "dpp", "a", "d", timed_ms=[1.0],
                                                                round_medians=[1.0])], [], {}, {}, 1.0)
    assert "Per round" not in report.read_text()
    # The host's launch rate and the CPU binding are stated with the card (calls on other hosts differ).
    write_report(report, BenchConfig(device="cpu", cpu_bind="none"), [meg], [], {}, {}, 1.0,
                 host="10.00 µs per eager kernel launch on NVIDIA H100 80GB HBM3 (host side)")
    text = report.read_text()
    assert "Host: 10.00 µs per eager kernel launch on NVIDIA H100 80GB HBM3 (host side)." in text
    assert "CPU binding none" in text


def test_report_names_the_fastest_dpp_line_within_the_memory_bound_and_the_goal(tmp_path) -> None:
    from trainer.bench.report import write_report
    from trainer.bench.results import LineResult

    def line(name: str, ms: float, gib: float, scenario: str = "a") -> LineResult:
        return LineResult(f"{scenario}-{name}", name, scenario, name, timed_ms=[ms], round_medians=[ms],
                          reserved_gib=gib)

    results = [line("megatron-1f1b-best", 570.0, 11.67), line("dpp-graphs", 480.0, 13.49),  # over 1.10x memory
               line("dpp-graphs-rs2", 550.0, 12.11), line("megatron-interleaved-v2", 600.0, 11.79),
               line("dpp-graphs-v2", 540.0, 23.0), line("megatron-1f1b-best", 700.0, 11.67, "c"),
               line("dpp-graphs-rs2", 650.0, 12.11, "c")]
    report = tmp_path / "r.md"
    write_report(report, BenchConfig(device="cpu"), results, [], {}, {}, 1.0)
    text = report.read_text()
    assert ("- v=1: fastest DPP line within 1.10x megatron-1f1b-best's memory: **dpp-graphs-rs2**, 1.036x at "
            "1.038x the memory — goal >= 1.05x: **missed**.") in text
    assert "- v=2: no DPP line within 1.10x megatron-interleaved-v2's peak reserved memory." in text
    assert "**dpp-graphs-rs2**, 1.077x at 1.038x the memory — goal >= 1.10x: **missed**." in text  # (c)


def test_scenario_d_reads_the_corpus_with_variable_lengths(tmp_path) -> None:
    """Scenario (d): the same lines on a real GPT-2-tokenized corpus instead of mock documents; the
    tokens the report counts are the corpus pieces the trainer reads (here a tiny preprocessed corpus)."""
    import json
    import subprocess
    import sys

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "word " * n}) + "\n" for n in (3, 40, 90, 7, 200, 15, 60, 33)))
    prefix = tmp_path / "corpus"
    repo = Path(__file__).resolve().parents[2]
    vocab, merges = str(repo / "datasets/gpt2/vocab.json"), str(repo / "datasets/gpt2/merges.txt")
    subprocess.run([sys.executable, "-m", "trainer.preprocess", "--input", str(docs), "--output-prefix", str(prefix),
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                    "--append-eod"], check=True, capture_output=True, cwd=repo)
    corpus = f"{prefix}_text_document"
    cfg = BenchConfig(corpus=corpus, seq_length=64, num_microbatches=4, micro_batch_size=2, train_iters=2,
                      seq_length_divisible_by=16, vocab_file=vocab, merge_file=merges)
    planned = plan(cfg, ["megatron-1f1b-best", "dpp-graphs", "direct-megatron"], ["d"], ("dpp",))
    lines = [p for p in planned if isinstance(p, Line)]
    assert [ln.name for ln in lines] == ["megatron-1f1b-best", "dpp-graphs"]
    assert "reads a corpus" in next(p.reason for p in planned if isinstance(p, NotRun))
    for line in lines:
        assert "--mock-data" not in line.args and line.args[line.args.index("--data-path") + 1] == corpus
        assert "--variable-seq-lengths" in line.args and "--mock-seq-len-dist" not in line.args
        parse_config(line.args, world_size=cfg.pipeline_parallel)
    real, padded = variable_length_tokens(cfg, "d")
    assert 0 < real <= padded <= cfg.global_batch_size * cfg.seq_length
    no_corpus = plan(BenchConfig(), ["dpp"], ["d"], ("dpp",))
    assert isinstance(no_corpus[0], NotRun) and "needs --corpus" in no_corpus[0].reason
