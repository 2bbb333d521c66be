"""trainer.bench.experiments / trainer.bench.run: every experiment names lines, scenarios, layouts and a model
the benchmark knows, and the runner's dated file carries the header fields a reader needs (pure parts;
the runs themselves: tests/dist/test_bench_run.py)."""

from __future__ import annotations

import datetime
from pathlib import Path

from trainer.bench.experiments import EXPERIMENTS, MODELS
from trainer.bench.layouts import parse_layouts
from trainer.bench.lines import SCENARIOS, line_entry
from trainer.bench.run import REQUIRED_FIELDS, header, result_path, tool_command


def test_the_named_experiments_exist_and_name_known_parts() -> None:
    assert {"schedule-vs-static", "layouts", "transport"} <= set(EXPERIMENTS)
    for exp in EXPERIMENTS.values():
        assert exp.tool in ("pipeline", "transport")
        assert exp.model in MODELS and exp.question.endswith(("?", "."))
        assert [n for n in exp.lines if line_entry(n) is None] == []
        assert set(exp.scenarios) <= set(SCENARIOS)
        assert parse_layouts(",".join(exp.layouts))[1] == []
        assert exp.gpus >= 2


def test_scenario_d_is_left_out_without_a_corpus_and_said_so(tmp_path: Path) -> None:
    exp = EXPERIMENTS["schedule-vs-static"]
    argv, notes = tool_command(exp, "cuda", 4, "gpt16-h2048", "", tmp_path, tmp_path / "r.md", [])
    assert argv[argv.index("--scenarios") + 1] == "a,c" and notes == ["scenario d not run: no --corpus given"]
    assert argv[argv.index("--pipeline-parallel") + 1] == "4"
    argv, notes = tool_command(exp, "cuda", 2, "gpt16-h2048", "corp", tmp_path, tmp_path / "r.md", [])
    assert argv[argv.index("--scenarios") + 1] == "a,c,d" and not notes and "--corpus" in argv
    layouts, _ = tool_command(EXPERIMENTS["layouts"], "cuda", 4, "gpt16-h2048", "", tmp_path, tmp_path / "r.md", [])
    assert "--pipeline-parallel" not in layouts
    assert "4x1x1,2x2x1+sp,2x1x2+overlap+distopt,4x1x1@bert16-h2048" in layouts


def test_result_files_are_dated_and_never_overwritten(tmp_path: Path) -> None:
    first = result_path(tmp_path, "2026-11-28", "transport", "2xH200")
    assert first.name == "2026-11-28-transport-2xH200.md"
    first.write_text("x")
    assert result_path(tmp_path, "2026-11-28", "transport", "2xH200").name == "2026-11-28-transport-2xH200-2.md"


def test_header_has_every_required_field() -> None:
    when = datetime.datetime(2026, 11, 28, 3, 50, tzinfo=datetime.UTC)
    text = "\n".join(header(EXPERIMENTS["schedule-vs-static"], when, "4 x NVIDIA H200", {"torch": "2.11"}, "abc123",
                            "gpt16-h2048", 4, "python -m trainer.bench.run schedule-vs-static", "python -m x", []))
    for field in REQUIRED_FIELDS:
        assert f"| {field} |" in text
    assert "2026-11-28 03:50 UTC" in text and "gpt16-h2048" in text and "1f1b-graphs" in text


def test_flags_after_a_double_dash_go_to_the_tool(capsys) -> None:
    from trainer.bench.run import main

    assert main(["transport", "--device", "cpu", "--dry-plan", "--", "--repeats", "3"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.endswith("--repeats 3") and "--sizes 64K,1M" in printed


def test_scenarios_subset_runs_one_scenario_per_call(tmp_path: Path, capsys) -> None:
    """A call with a time limit runs one scenario: --scenarios reaches the tool and the header, and a
    scenario the experiment does not run is refused by name before anything starts."""
    from trainer.bench.run import main, scenario_problems

    exp = EXPERIMENTS["schedule-vs-static"]
    assert scenario_problems(exp, None) == (None, [])
    assert scenario_problems(exp, "c") == (["c"], [])
    chosen, problems = scenario_problems(exp, "a,b")
    assert chosen is None and problems == ["--scenarios='a,b': schedule-vs-static runs scenarios a,c,d (got unknown b)"]
    argv, notes = tool_command(exp, "cuda", 4, "gpt16-h2048", "", tmp_path, tmp_path / "r.md", [], ["c"])
    assert argv[argv.index("--scenarios") + 1] == "c" and not notes
    when = datetime.datetime(2026, 11, 28, 3, 50, tzinfo=datetime.UTC)
    text = "\n".join(header(exp, when, "4 x H200", {}, "abc", "gpt16-h2048", 4, "cmd", "tool", [], ["c"]))
    assert "scenarios c;" in text
    assert main(["schedule-vs-static", "--scenarios", "x", "--dry-plan"]) == 2
    assert "--scenarios='x'" in capsys.readouterr().err


def test_the_runner_prints_each_headline_with_its_three_ratios() -> None:
    from trainer.bench.run import headline_lines

    report = Path(__file__).parents[2] / "docs" / "bench" / "2026-11-28-schedule-vs-static-4xH200.md"
    lines = headline_lines(report.read_text())
    assert lines[0] == "### (a) uniform" and lines[1].startswith("**Headline**")
    assert [ln[:3] for ln in lines[2:]] == ["1. ", "2. ", "3. "]
    assert "1.231x" in lines[4] and not any("(c)" in ln for ln in lines)  # a scenario not run prints nothing


def test_time_limit_stops_the_tool_and_the_processes_it_started() -> None:
    """A call with a time limit must end with a result file: past --time-limit the runner stops the
    tool's whole process group (the ranks too) and says so, instead of being killed with nothing written."""
    import os
    import sys
    import time

    from trainer.bench.run import run_tool

    sleeper = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
               " print(c.pid, flush=True); time.sleep(300)")
    start = time.monotonic()
    result, note = run_tool([sys.executable, "-c", sleeper], True, 2.0)
    assert time.monotonic() - start < 60, "run_tool did not stop the tool within its grace period"
    assert result.returncode == 124 and "cut off by --time-limit 2 s" in note
    child = int(result.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the grandchild got SIGTERM with its group; wait for it to go
        try:
            with open(f"/proc/{child}/status") as status:
                if "\nState:\tZ" in status.read():
                    break  # dead, not yet reaped by whoever adopted it
        except FileNotFoundError:
            break
        time.sleep(0.2)
    else:
        os.kill(child, 9)
        raise AssertionError(f"the tool's child {child} still runs 30 s after the time limit")
    done, _ = run_tool([sys.executable, "-c", "print('ok')"], True, 30.0)
    assert done.returncode == 0 and done.stdout.strip() == "ok"
def test_llama_experiment_plans_llama_lines_every_flag_accepted(tmp_path: Path, capsys) -> None:
    """The Llama line's CPU dry plan (tiny-llama) and its GPU plan (llama16-h2048, PP=4): every planned
    trainer command carries the Llama block's flags and passes the trainer's own configuration checks."""
    import shlex

    from trainer.bench.pipeline import main as pipeline_main
    from trainer.config import parse_config

    exp = EXPERIMENTS["llama"]
    assert MODELS[exp.model].num_layers == MODELS["gpt16-h2048"].num_layers  # the GPT model's size class
    assert MODELS[exp.model].hidden_size == MODELS["gpt16-h2048"].hidden_size
    for device, gpus, model in (("cpu", 2, exp.cpu_model), ("cuda", 4, exp.model)):
        argv, _ = tool_command(exp, device, gpus, model, "", tmp_path, tmp_path / "r.md", [])
        assert pipeline_main(argv[3:] + ["--dry-plan"]) == 0
        commands = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines() if ": python -m " in line]
        assert len(commands) == len(exp.lines), commands
        for command in commands:
            args = shlex.split(command)[3:]  # after "python -m trainer.train"
            for flag in ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights"):
                assert flag in args, (flag, command)
            cfg = parse_config(args, world_size=gpus)
            assert cfg.model.swiglu and cfg.model.normalization == "RMSNorm"


def test_a_report_left_by_an_earlier_run_is_never_written_as_this_runs(tmp_path: Path, monkeypatch) -> None:
    """Two calls of one day into one --out: the second (scenario c only) gets its own file name, and when
    its tool writes no report, the result file says so -- it does not take the first call's report and
    timelines for its own."""
    import subprocess

    import trainer.bench.run as bench_run

    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    (out / "report.md").write_text("# old\n\n### (a) uniform\nstale figures\n")
    (out / "report.timeline-a-dpp.png").write_bytes(b"old png")
    monkeypatch.setattr(bench_run, "run_tool", lambda tool, capture, limit: (
        subprocess.CompletedProcess(tool, 1, "", ""), ""))
    assert bench_run.main(["schedule-vs-static", "--scenarios", "c", "--device", "cpu",
                           "--out", str(out), "--results", str(results)]) in (0, 1)
    written = sorted(p.name for p in results.iterdir())
    assert len(written) == 1 and written[0].endswith("-schedule-vs-static-c-cpu.md"), written
    text = (results / written[0]).read_text()
    assert "The tool wrote no report" in text and "stale figures" not in text
    assert not (out / "report.timeline-a-dpp.png").exists()


def test_the_result_header_names_the_layouts_the_tool_ran() -> None:
    from trainer.bench.run import layouts_as_run

    assert layouts_as_run(["x", "--layouts", "4x1x1,2x2x1+sp", "--lines", "a", "--layouts", "4x1x1@bert16-h2048"]) \
        == ["4x1x1@bert16-h2048"]
    assert layouts_as_run(["x", "--layouts=2x1x2+overlap"]) == ["2x1x2+overlap"]
    assert layouts_as_run(["x", "--lines", "a"]) == []


def test_the_result_header_names_the_lines_the_tool_ran() -> None:
    """A call that gives its own --lines after ``--`` (the experiment's come first) is described by them."""
    from trainer.bench.run import as_run

    exp = EXPERIMENTS["layouts"]
    tool = ["x", "--lines", ",".join(exp.lines), "--layouts", "4x1x1", "--lines", "megatron-1f1b-best,1f1b-graphs"]
    assert as_run(tool, "--lines") == ["megatron-1f1b-best", "1f1b-graphs"]
    when = datetime.datetime(2026, 11, 28, tzinfo=datetime.UTC)
    text = "\n".join(header(exp, when, "4 x H200", {}, "abc", exp.model, 4, "cmd", "tool", [], None,
                            as_run(tool, "--layouts"), as_run(tool, "--lines")))
    assert "lines megatron-1f1b-best, 1f1b-graphs; scenarios" in text and "dpp-default" not in text


def test_the_commit_line_names_the_tree_that_ran_when_it_differs_from_the_commit(tmp_path) -> None:
    """A result written from uncommitted files (or a copy of a newer tree beside an older history) names the
    git tree those files form, which is the tree of the commit that holds them once committed."""
    import subprocess

    from trainer.bench.run import commit

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "bench@example.com")
    git("config", "user.name", "bench")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    assert commit(tmp_path) == git("rev-parse", "--short", "HEAD")
    (tmp_path / "a.py").write_text("two\n")
    line = commit(tmp_path)
    assert line.startswith(git("rev-parse", "--short", "HEAD") + " with uncommitted changes (working tree ")
    assert git("status", "--porcelain") == "M a.py"  # the checkout's own index untouched
    git("commit", "-qam", "two")
    assert git("rev-parse", "HEAD^{tree}")[:12] in line
