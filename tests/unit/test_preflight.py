"""workflows.preflight: image paths and partition limits checked before submitting."""

from __future__ import annotations

import pytest

from workflows import preflight, slurm

SCONTROL = (
    "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED Nodes=node[1-2] State=UP TotalNodes=2\n"
    "PartitionName=gpu AllowGroups=ALL MaxNodes=4 Nodes=gpu[01-16] State=UP TotalNodes=16\n"
)


def test_parse_partitions():
    assert slurm.parse_partitions(SCONTROL) == [
        slurm.Partition("debug", total_nodes=2, max_nodes=None, default=True),
        slurm.Partition("gpu", total_nodes=16, max_nodes=4, default=False),
    ]


@pytest.mark.parametrize(("nodes", "partition", "problem"), [
    (2, None, None),
    (3, None, "--nodes 3: partition debug has 2 node(s); the job would pend forever"),
    (4, "gpu", None),
    (5, "gpu", "--nodes 5: partition gpu allows at most 4 node(s) per job (MaxNodes)"),
    (1, "big", "--partition big: no such partition (this cluster has: debug, gpu)"),
])
def test_nodes_are_checked_against_the_partition(monkeypatch, nodes, partition, problem):
    monkeypatch.setattr(preflight.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm, "run", lambda args, **kw: SCONTROL)
    problems = preflight.partition_problems(nodes, partition)
    assert problems == ([] if problem is None else [problem + problems[0][len(problem):]])
    if problem:
        assert problems[0].startswith(problem)


def test_partition_check_is_skipped_without_slurm(monkeypatch):
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    assert preflight.partition_problems(99, None) == []


def test_image_paths_must_exist(tmp_path):
    image = tmp_path / "mdpp.sqsh"
    assert preflight.image_problems(str(image)) == [
        f"--image {image}: no such file (build one with containers/build.sh, or containers/build-offline.sh"
        " for the CPU image, or name a registry image such as nvcr.io#nvidia/pytorch:24.07-py3)"]
    assert "is a directory" in preflight.image_problems(str(tmp_path))[0]
    image.write_bytes(b"hsqs")
    assert preflight.image_problems(str(image)) == []
    for registry in ("nvcr.io#nvidia/pytorch:24.07-py3", "ubuntu:22.04", None):
        assert preflight.image_problems(registry) == []
