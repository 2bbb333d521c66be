"""containers/: there is no Docker engine here, so these are lint checks of the Dockerfile and build.sh (the
enroot/Pyxis path runs for real in tests/containers/).

What they pin down: the image copies only paths that exist, installs every runtime dependency of
pyproject.toml except the two the NGC base must keep (torch, numpy), and puts the package where the
sbatch files' Pyxis flags expect it; build.sh ends in `enroot import` and fails clearly without docker.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

from workflows import jobs

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "containers" / "Dockerfile"
BUILD = REPO / "containers" / "build.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_base_is_ngc_pytorch_and_workdir_matches_the_sbatch_files():
    steps = instructions()
    args = dict((k, v) for k, v in steps if k == "ARG")
    assert args["ARG"].startswith("BASE_IMAGE=nvcr.io/nvidia/pytorch:")
    assert ("FROM", "${BASE_IMAGE}") in steps
    assert ("WORKDIR", jobs.CONTAINER_WORKDIR) in steps


def test_every_copied_path_exists_and_the_package_is_complete():
    copied = []
    for instruction, arguments in instructions():
        if instruction == "COPY":
            *sources, _destination = shlex.split(arguments)
            copied += sources
    for source in copied:
        assert (REPO / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    # what `pip install -e .` builds and what the jobs read at run time
    assert {"pyproject.toml", "setup.py", "csrc", "trainer", "workflows", "datasets"} <= set(copied)


def test_runtime_dependencies_are_installed_except_the_base_images_own():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    runs = " ".join(arguments for instruction, arguments in instructions() if instruction == "RUN")
    for requirement in declared:
        name = re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0]
        if name in {"torch", "numpy"}:
            assert f'"{requirement}"' not in runs, f"{name} must come from the NGC base image"
        else:
            assert f'"{requirement}"' in runs, f"Dockerfile does not install {requirement}"
    assert "--no-deps --no-build-isolation -e ." in runs
    assert "import trainer.transport._shm_ring" in runs  # the extension is built into the image


def test_build_script_imports_into_enroot_and_fails_clearly_without_docker(tmp_path):
    text = BUILD.read_text()
    assert "docker build" in text and 'enroot import -o "$OUTPUT" "dockerd://$NAME:latest"' in text
    assert os.access(BUILD, os.X_OK)
    subprocess.run(["bash", "-n", str(BUILD)], check=True)
    # A PATH holding only what build.sh needs before its checks: no docker, whatever the machine has.
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "dirname").symlink_to(shutil.which("dirname"))
    result = subprocess.run([shutil.which("bash"), str(BUILD)], env={"PATH": str(tools), "HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=30, check=False)
    assert (result.returncode, result.stderr.strip()) == (
        2, "build.sh: error: docker not found: build on a machine with the Docker engine")
