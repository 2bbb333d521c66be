"""The committed sbatch files work on their own: `sbatch sbatch/1.data-preprocessing.sbatch`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.corpus import small_corpus
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


@pytest.mark.timeout(300)
def test_preprocessing_sbatch_submitted_from_elsewhere_runs_this_repository(tmp_path):
    """Submitted from a folder that is not the repository (no REPO_DIR): the file finds its
    repository through the job's Command; a copy of it lying outside says to set REPO_DIR."""
    corpus = small_corpus(tmp_path / "corpus.jsonl", documents=50)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("REPO_DIR", "PYTHONPATH")}
    env.update(DATA_PATH=str(tmp_path / "data"), INPUT=str(corpus))
    copy = elsewhere / "1.data-preprocessing.sbatch"
    copy.write_text((REPO / "sbatch" / copy.name).read_text())
    ids = {}
    for what, script in (("original", REPO / "sbatch" / copy.name), ("copy", copy)):
        submitted = slurm.run(["sbatch", "--parsable", f"--output={tmp_path}/{what}_%j.out", str(script)],
                              cwd=str(elsewhere), env=env)
        ids[what] = submitted.strip().split(";")[0]
    original = wait_finished(ids["original"], timeout_s=240)
    log = (tmp_path / f"original_{ids['original']}.out").read_text()
    assert original.state == "COMPLETED", log
    assert (tmp_path / "data" / "gpt2" / "sample_text_document.bin").stat().st_size > 0, log
    refused = wait_finished(ids["copy"], timeout_s=120)
    log = (tmp_path / f"copy_{ids['copy']}.out").read_text()
    assert refused.state == "FAILED" and refused.exit_code == "2:0", log
    assert f"cannot find the repository: neither {copy}'s folder nor the submit folder {elsewhere} is one; " \
           "set REPO_DIR=<the repository folder>" in log, log
