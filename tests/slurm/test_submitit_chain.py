"""`python -m workflows.submit` through submitit on the real local cluster: the summary comes back to
the driver, a failed step's state, log tail and remote traceback are printed, and bad sbatch
parameters are refused before anything reaches the queue. (test_chain.py runs the same driver on
the longer paths: BERT, failing preprocessing, requeue and USR1 resume.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.corpus import small_corpus
from tests.slurm.test_chain import CHAIN_TIMEOUT_S, REPO, finish_submit, start_submit
from tests.timeouts import ceiling

SHORT = ["--train-iters", "4"]
FEW_DOCUMENTS = 20  # the failing chain's corpus: its training stops at the flag check, before any sample


# The chains' waits are stretched by the load (tests/slurm/test_chain.py, CHAIN_TIMEOUT_S): the bound
# here only backs them up (pytest's default, 600 s, struck first under two test runs at once).
@pytest.mark.timeout(ceiling(CHAIN_TIMEOUT_S) + 120)
def test_submitit_chain_returns_the_summary_and_reports_a_failed_step_with_its_traceback(tmp_path):
    corpus = small_corpus(tmp_path / "corpus.jsonl")
    good = start_submit(tmp_path / "runs", corpus, "gpt", "--nodes", "2", *SHORT,
                        "--sbatch-arg", "comment=nightly", "--time", "00:20:00")
    bad = start_submit(tmp_path / "runs", small_corpus(tmp_path / "few.jsonl", FEW_DOCUMENTS), "gpt", "--nodes", "2",
                       *SHORT, "--env", "EXTRA_TRAIN_ARGS=--no-such-flag")
    ok, failed = finish_submit(good), finish_submit(bad)

    assert ok.returncode == 0, ok.describe()
    assert ok.states() == {"preprocess": "COMPLETED", "train": "COMPLETED", "aggregate": "COMPLETED"}
    assert "summary: dpp PP=2 microbatches=8 iterations=4" in ok.stdout, ok.describe()
    assert "bubble" in ok.stdout and "stage 0: busy" in ok.stdout and "stage 1: busy" in ok.stdout
    assert "  stage balance: " in ok.stdout, ok.describe()  # fitted to the run's own stage times
    batch = (ok.run_dir / "submitit" / f"{ok.job_ids['train']}_submission.sh").read_text()
    for line in ("#SBATCH --dependency=afterok:", "#SBATCH --kill-on-invalid-dep=yes", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@60", "#SBATCH --time=00:20:00", "#SBATCH --comment=nightly", "exec "):
        assert line in batch, (line, batch)
    # The chain passed the run's own name to the trainer (it was "run" for every chain run).
    traces = sorted((ok.run_dir / "traces").glob("trace_rank*.json"))
    assert len(traces) == 2, traces
    for trace in traces:
        assert f'"run_name":"{ok.run_dir.name}"' in trace.read_text().replace(" ", ""), trace
    # The step ran the committed file's bytes.
    assert (ok.run_dir / "sbatch" / "2.distributed-training.sbatch").read_text() == \
        (REPO / "sbatch" / "2.distributed-training.sbatch").read_text()

    assert failed.returncode == 1, failed.describe()
    assert failed.states()["train"] == "FAILED"
    assert f"train job {failed.job_ids['train']}: FAILED, exit code 1:0" in failed.stderr
    assert "unknown flags (neither this trainer's nor Megatron-LM's; see --help): --no-such-flag" \
        in failed.stderr  # the log tail
    assert "remote traceback (submitit):" in failed.stderr
    # The script's status is srun's: 2 (the rank's config error) or 143 (--kill-on-bad-exit ended
    # the other rank first), whichever srun saw first.
    assert re.search(r"StepFailed: train: `bash \S+` exited [1-9][0-9]*", failed.stderr), failed.stderr


def test_bad_sbatch_parameters_are_refused_before_anything_is_queued(tmp_path):
    done = subprocess.run([sys.executable, "-m", "workflows.submit", "gpt", "--nodes", "2", "--time", "forever",
                           "--qos", "a b", "--sbatch-arg", "dependency=afterok:1", "--runs-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "--time 'forever'" in done.stderr and "--qos 'a b'" in done.stderr and "dependency" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # the run folder is made before the first submission: none was
