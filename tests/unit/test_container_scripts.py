"""The container set-up scripts' cheap paths, which CI can run without building anything.

scripts/install-enroot-pyxis.sh refuses, before installing anything, to run without both source
folders, with folders that are not enroot's/Pyxis's, or with sources inside this repository;
scripts/cluster.sh plugstack registers Pyxis exactly when the plugin file exists. The real build,
install and a chain under Pyxis are tests/containers/ (skipped where enroot/Pyxis are absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install-enroot-pyxis.sh"
CLUSTER = REPO / "scripts" / "cluster.sh"


def run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("ENROOT_SRC", "PYXIS_SRC", "PYXIS_PLUGIN")}
    return subprocess.run(["bash", str(script), *args], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=False)


def fake_sources(root: Path) -> tuple[Path, Path]:
    enroot, pyxis = root / "enroot", root / "pyxis"
    enroot.mkdir(parents=True)
    pyxis.mkdir(parents=True)
    (enroot / "enroot.in").write_text("")
    (pyxis / "pyxis_slurmstepd.c").write_text("")
    return enroot, pyxis


def test_install_without_sources_says_what_to_give_and_installs_nothing():
    done = run(INSTALL)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "install-enroot-pyxis: error: both sources must be given: --enroot-src DIR (a clone of "
        "github.com/NVIDIA/enroot) and --pyxis-src DIR (a clone of github.com/NVIDIA/pyxis), or "
        "ENROOT_SRC/PYXIS_SRC; nothing is downloaded by this script"]


def test_install_names_every_folder_that_is_not_a_source(tmp_path):
    done = run(INSTALL, "--enroot-src", str(tmp_path), "--pyxis-src", str(tmp_path))
    assert done.returncode == 2
    assert f"--enroot-src {tmp_path}: no enroot.in there" in done.stderr
    assert f"--pyxis-src {tmp_path}: no pyxis_slurmstepd.c there" in done.stderr
    assert run(INSTALL, "--enroot-src").returncode != 0  # a flag without its folder


def test_install_refuses_third_party_sources_inside_the_repository(tmp_path):
    inside = REPO / "build" / f"test-sources-{os.getpid()}"
    try:
        enroot, pyxis = fake_sources(inside)
        outside_enroot, _ = fake_sources(tmp_path)
        done = run(INSTALL, ENROOT_SRC=str(enroot), PYXIS_SRC=str(pyxis))
        assert done.returncode == 2
        assert "is inside this repository: keep third-party sources outside it" in done.stderr
        done = run(INSTALL, "--enroot-src", str(outside_enroot), "--pyxis-src", str(pyxis))
        assert done.returncode == 2 and f"--pyxis-src {pyxis} is inside this repository" in done.stderr
    finally:
        shutil.rmtree(inside, ignore_errors=True)


def test_cluster_plugstack_registers_pyxis_only_when_the_plugin_exists(tmp_path):
    cluster_dir, plugin = tmp_path / "cluster", tmp_path / "spank_pyxis.so"
    plugin.write_bytes(b"")
    done = run(CLUSTER, "plugstack", MDPP_CLUSTER_DIR=str(cluster_dir), PYXIS_PLUGIN=str(plugin))
    assert done.returncode == 0, done.stderr
    lines = (cluster_dir / "etc" / "plugstack.conf").read_text().splitlines()
    assert [line for line in lines if not line.startswith("#")] == [f"required {plugin} use_squashfuse=1"]
    plugin.unlink()
    done = run(CLUSTER, "plugstack", MDPP_CLUSTER_DIR=str(cluster_dir), PYXIS_PLUGIN=str(plugin))
    assert done.returncode == 0 and not (cluster_dir / "etc" / "plugstack.conf").exists()
    assert f"no Pyxis at {plugin}" in done.stderr
