"""The committed sbatch files work on their own: `sbatch sbatch/1.data-preprocessing.sbatch`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.slurm.test_chain import small_corpus
from workflows import slurm

REPO = Path(__file__).resolve().parents[2]


def wait_finished(job_id: str, timeout_s: float) -> slurm.JobRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = slurm.query(job_ids=[job_id])
        if records and records[0].finished:
            return records[0]
        time.sleep(1)
    slurm.call(["scancel", job_id])
    raise AssertionError(f"job {job_id} not finished after {timeout_s:.0f} s (last: {records}); cancelled it")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "dataset"), [("gpt", "gpt2/sample_text_document"),
                                                ("bert", "bert/sample_text_sentence")])
def test_preprocessing_sbatch_alone_produces_the_dataset(tmp_path, model, dataset):
    corpus = small_corpus(tmp_path / "corpus.jsonl", documents=100)
    env = {**os.environ, "DATA_PATH": str(tmp_path / "data"), "INPUT": str(corpus)}
    if model != "gpt":
        env["MODEL"] = model
    # As a user would: from the repository, no options, settings through the environment.
    submitted = slurm.run(["sbatch", "--parsable", f"--output={tmp_path}/%x_%j.out",
                           "sbatch/1.data-preprocessing.sbatch"], cwd=str(REPO), env=env)
    job_id = submitted.strip().split(";")[0]
    record = wait_finished(job_id, timeout_s=240)
    log = (tmp_path / f"mdpp-preprocess_{job_id}.out").read_text()
    assert record.state == "COMPLETED", log
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "data" / f"{dataset}{suffix}").stat().st_size > 0, log
    assert f"-> {tmp_path}/data/{dataset.split('_text')[0]} ({model}/cpu)" in log
