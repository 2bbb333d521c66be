"""workflows.status with sacct's answers canned: right for any id."""

from __future__ import annotations

import pytest

from workflows import slurm, status

STEM = "mdpp-gpt-20261126-070855-e4f5"
JOBS = {  # what the cluster knows: an unrelated job 1, a chain whose preprocessing failed
    "1": "1|t1.sh|COMPLETED|0:0|00:00:01|node1|x|y",
    "18": f"18|{STEM}-preprocess|FAILED|1:0|00:00:01|node1|x|y",
    "19": f"19|{STEM}-train|CANCELLED by 0|0:0|00:00:00|None assigned|None|y",
    "20": f"20|{STEM}-aggregate|COMPLETED|0:0|00:00:01|node1|x|y",
}


def fake_sacct(args):
    """sacct as this cluster answers: `-j 0` lists every job; a name query with a time window leaves
    out the never-eligible cancelled job unless --state is given."""
    if "-j" in args:
        wanted = args[args.index("-j") + 1]
        return "\n".join(JOBS.values()) if wanted == "0" else JOBS.get(wanted, "")
    names = args[args.index("--name") + 1].split(",")
    rows = [row for row in JOBS.values() if row.split("|")[1] in names]
    if "--state" not in args:
        rows = [row for row in rows if "CANCELLED" not in row]
    return "\n".join(rows)


@pytest.fixture(autouse=True)
def canned(monkeypatch):
    monkeypatch.setattr(slurm, "run", lambda args, **kw: fake_sacct(list(args)))


@pytest.mark.parametrize("job_id", ["0", "00", "77"])
def test_an_id_sacct_does_not_know_is_an_error_never_another_chain(job_id, capsys):
    with pytest.raises(SystemExit) as info:
        status.main([job_id])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"python -m workflows.status: error: job {int(job_id)}: not found in sacct"
    assert captured.out == ""


@pytest.mark.parametrize("job_id", ["18", "19", "20", "019"])
def test_a_job_cancelled_by_a_failed_dependency_is_listed(job_id, capsys):
    assert status.main([job_id]) == status.EXIT_FAILED
    out = capsys.readouterr().out
    rows = [line.split()[:3] for line in out.splitlines()[1:4]]
    assert rows == [["18", f"{STEM}-preprocess", "FAILED"], ["19", f"{STEM}-train", "CANCELLED"],
                    ["20", f"{STEM}-aggregate", "COMPLETED"]], out
    assert out.rstrip().endswith("chain: FAILED")


def test_a_job_of_no_chain_is_shown_alone_and_said_so(capsys):
    assert status.main(["1"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["JobID", "1", "job"]
    assert out.rstrip().endswith("job 1: COMPLETED (not a workflows.submit chain: shown alone)")
