"""`python -m workflows.submit` on the real local cluster: whole chains, failures, status.

The chains of this module are submitted together when the first test asks for one (they share
the cluster's 2 x 8 declared CPUs; sequential submission would only add scheduling latency), and
each test then waits for its own. Every chain tokenizes a small slice of the shipped corpus so
that preprocessing takes seconds; the slice is what every chain of the session trains on.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from workflows import slurm

REPO = Path(__file__).resolve().parents[2]
CHAIN_TIMEOUT_S = 420  # one chain alone takes ~1 min here; several share 2 cores
CORPUS_DOCUMENTS = 300
ITERATION_LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.eE+-]+)")


@dataclass
class SubmitResult:
    """What `python -m workflows.submit ... --wait` printed and left behind."""

    returncode: int
    stdout: str
    stderr: str
    job_ids: dict[str, str]
    run_dir: Path

    def describe(self) -> str:
        logs = ""
        for log in sorted((self.run_dir / "logs").glob("*.out")) if self.run_dir.name else []:
            logs += f"\n---- {log.name}\n{log.read_text()[-3000:]}"
        return f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}{logs}"

    def log(self, step: str) -> str:
        return (self.run_dir / "logs" / f"mdpp-{self.run_dir.name}-{step}_{self.job_ids[step]}.out").read_text()

    def states(self) -> dict[str, str]:
        records = {r.job_id: r.state for r in slurm.query(job_ids=list(self.job_ids.values()))}
        return {step: records.get(job_id, "MISSING") for step, job_id in self.job_ids.items()}


def small_corpus(path: Path, documents: int = CORPUS_DOCUMENTS) -> Path:
    """The first ``documents`` lines of the shipped corpus, uncompressed."""
    with lzma.open(REPO / "datasets" / "python-docs.jsonl.xz", "rt") as src:
        lines = [next(src) for _ in range(documents)]
    assert all(json.loads(line)["text"] for line in lines)
    path.write_text("".join(lines))
    return path


def start_submit(runs_dir: Path, corpus: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "workflows.submit", *args, "--wait", "--timeout", str(CHAIN_TIMEOUT_S),
            "--runs-dir", str(runs_dir), "--env", f"INPUT={corpus}"]
    return subprocess.Popen(argv, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_submit(proc: subprocess.Popen) -> SubmitResult:
    try:
        stdout, stderr = proc.communicate(timeout=CHAIN_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"submit --wait did not return within {CHAIN_TIMEOUT_S + 60} s:\n{stdout}\n{stderr}")
    job_ids = dict(re.findall(r"^(preprocess|train|aggregate)\s+job (\d+)$", stdout, re.M))
    logs = re.search(r"^logs:\s+(\S+)$", stdout, re.M)
    run_dir = Path(logs.group(1)).parent if logs else Path()
    return SubmitResult(proc.returncode, stdout, stderr, job_ids, run_dir)


def final_loss(train_log: str) -> tuple[int, str]:
    """(iteration, loss text) of the last iteration line the trainer logged."""
    found = ITERATION_LOSS.findall(train_log)
    assert found, f"no iteration/loss line in the training log:\n{train_log[-3000:]}"
    iteration, _total, loss = found[-1]
    return int(iteration), loss


CHAINS = {
    "gpt": ["gpt", "--nodes", "2"],
    "bert": ["bert", "--nodes", "2"],
    "bad_train_flag": ["gpt", "--nodes", "2", "--env", "EXTRA_TRAIN_ARGS=--no-such-flag"],
    "bad_tokenizer": ["gpt", "--nodes", "2", "--env", "TOKENIZER_TYPE=NoSuchTokenizer"],
}


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Start every chain of this module at once; ``chains(name)`` waits for one and caches it."""
    root = tmp_path_factory.mktemp("chains")
    corpus = small_corpus(root / "corpus.jsonl")
    procs = {name: start_submit(root / "runs", corpus, *args) for name, args in CHAINS.items()}
    results: dict[str, SubmitResult] = {}

    def get(name: str) -> SubmitResult:
        if name not in results:
            results[name] = finish_submit(procs[name])
        return results[name]

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def assert_trained_chain(result: SubmitResult, model: str) -> None:
    assert result.returncode == 0, result.describe()
    assert result.states() == {"preprocess": "COMPLETED", "train": "COMPLETED", "aggregate": "COMPLETED"}
    assert "chain COMPLETED" in result.stdout
    # --wait showed the live states it went through, per job
    assert re.search(rf"train\s+{result.job_ids['train']} RUNNING", result.stdout), result.stdout
    suffix = "_text_sentence" if model == "bert" else "_text_document"
    dataset = result.run_dir / "data" / ("bert" if model == "bert" else "gpt2") / f"sample{suffix}"
    assert dataset.with_suffix(".bin").stat().st_size > 0 and dataset.with_suffix(".idx").stat().st_size > 0
    checkpoints = [p for p in (result.run_dir / "checkpoints").rglob("*") if p.is_file()]
    assert checkpoints, f"no checkpoint under {result.run_dir / 'checkpoints'}"
    traces = result.run_dir / "traces"
    assert len(list(traces.glob("trace_rank*.json"))) == 2  # one per rank: PP=2 over 2 nodes
    merged = json.loads((traces / "merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1}  # both stages
    summary = json.loads((traces / "summary.json").read_text())
    assert (summary["missing_ranks"], len(summary["iterations"])) == ([], 20)
    assert (traces / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    iteration, _loss = final_loss(result.log("train"))
    assert iteration == 20


@pytest.mark.timeout(CHAIN_TIMEOUT_S + 120)
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_submit_wait_completes_the_whole_chain(chains, model):
    assert_trained_chain(chains(model), model)


@pytest.mark.timeout(CHAIN_TIMEOUT_S + 120)
def test_status_shows_the_chain_from_any_job_id(chains):
    result = chains("gpt")
    assert result.returncode == 0, result.describe()
    for step in ("preprocess", "aggregate"):
        status = subprocess.run([sys.executable, "-m", "workflows.status", result.job_ids[step]], cwd=REPO,
                                capture_output=True, text=True, timeout=60, check=False)
        assert status.returncode == 0, status.stderr
        rows = [line.split() for line in status.stdout.splitlines()[1:4]]
        assert [(r[0], r[2]) for r in rows] == [(result.job_ids[s], "COMPLETED") for s in
                                                ("preprocess", "train", "aggregate")]
        assert status.stdout.rstrip().endswith("chain: COMPLETED")


@pytest.mark.timeout(CHAIN_TIMEOUT_S + 120)
def test_a_failing_training_job_fails_the_chain_fast_and_aggregation_still_reports(chains):
    result = chains("bad_train_flag")
    assert result.returncode == 1, result.describe()
    states = result.states()
    assert (states["preprocess"], states["train"]) == ("COMPLETED", "FAILED"), result.describe()
    assert states["aggregate"] in {"COMPLETED", "FAILED"}  # it ran: afterany
    train = next(r for r in slurm.query(job_ids=[result.job_ids["train"]]))
    hours, minutes, seconds = (int(x) for x in train.elapsed.split(":"))
    assert hours * 3600 + minutes * 60 + seconds < 60, f"training job took {train.elapsed} to fail"
    assert "--no-such-flag" in result.log("train")
    assert "aggregate: traces found in" in result.log("aggregate")
    assert "chain failed: train" in result.stderr


@pytest.mark.timeout(CHAIN_TIMEOUT_S + 120)
def test_a_failing_preprocessing_job_cancels_training_and_aggregation_still_runs(chains):
    result = chains("bad_tokenizer")
    assert result.returncode == 1, result.describe()
    states = result.states()
    assert states["preprocess"] == "FAILED" and states["train"] == "CANCELLED", result.describe()
    assert states["aggregate"] in {"COMPLETED", "FAILED"}  # afterany of a cancelled job still runs
    assert "aggregate: traces found in" in result.log("aggregate")


@pytest.mark.timeout(120)
def test_status_of_an_unknown_job_is_one_line_and_status_2():
    started = time.monotonic()
    status = subprocess.run([sys.executable, "-m", "workflows.status", "999999"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)
    assert (status.returncode, status.stderr.strip()) == (
        2, "python -m workflows.status: error: job 999999: not found in sacct")
    assert time.monotonic() - started < 30
