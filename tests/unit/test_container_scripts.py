"""The container set-up scripts' cheap paths, which CI can run without building anything.

scripts/install-enroot-pyxis.sh refuses, before installing anything, to run without both source
folders, with folders that are not enroot's/Pyxis's, or with sources inside this repository;
scripts/cluster.sh plugstack registers Pyxis exactly when the plugin file exists. The real build,
install and a chain under Pyxis are tests/containers/ (skipped where enroot/Pyxis are absent).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

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
        "install-enroot-pyxis: error: both sources must be given: --enroot-src DIR (NVIDIA/enroot's sources: "
        "a clone, a release tarball unpacked, or a git archive of a mirror) and --pyxis-src DIR (NVIDIA/pyxis's, "
        "likewise), or ENROOT_SRC/PYXIS_SRC; nothing is downloaded by this script, and no package registry has "
        "them"]


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


# The training file's IMAGE branch, wired up without Pyxis: `srun` runs the command it is given on
# the host (as each node would in the image) and records its options; `scontrol` knows two nodes.
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$*" >> "$FAKE_LOG"
command=()
for arg in "$@"; do
    if ((${#command[@]})) || [[ $arg != --* ]]; then command+=("$arg"); fi
done
case "${command[*]}" in
    *"workflows.nodes address"*)
        for node in node1 node2; do SLURMD_NODENAME=$node "${command[@]}" || exit; done ;;
    *"workflows.nodes env"*) exec "${command[@]}" ;;
    *) env > "$FAKE_LOG.ranks-env"; echo "done 20" > "$MDPP_EXIT_RECORD" ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf 'node1\\nnode2\\n' ;;
    "show node") printf 'NodeName=node1 Arch=x86_64 NodeAddr=10.9.0.1 NodeHostName=h\\n'
                 printf 'NodeName=node2 Arch=x86_64 NodeAddr=10.9.0.2 NodeHostName=h\\n' ;;
esac
"""


def test_with_an_image_the_training_file_probes_the_nodes_inside_it(tmp_path):
    if Path("/sys/class/infiniband").is_dir():
        pytest.skip("this host has InfiniBand: the probe would report its address, not Slurm's NodeAddr")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "srun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MDPP_")) and k not in ("IMAGE", "NODE_IPS")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), REPO_DIR=str(REPO),
               OUTPUT_DIR=str(tmp_path / "out"), DATA_PATH=str(tmp_path / "data"), IMAGE="/images/mdpp.sqsh",
               SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2")
    done = subprocess.run(["bash", str(REPO / "sbatch" / "2.distributed-training.sbatch")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    probe, gather, ranks = log.read_text().splitlines()
    pyxis = "--container-image=/images/mdpp.sqsh"
    assert probe.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1") and pyxis in probe
    assert probe.endswith("python3 -m workflows.nodes address")
    assert gather.startswith("--nodes=1 --ntasks=1") and pyxis in gather
    assert gather.endswith("python3 -m workflows.nodes env --addresses -")
    assert pyxis in ranks and "--node-ips 10.9.0.1,10.9.0.2 --multi-node" in ranks
    # Slurm's NodeAddr, read on the host, reached the probe; the exports reached the ranks.
    ranks_env = (tmp_path / "srun.log.ranks-env").read_text().splitlines()
    assert "MDPP_NODE_ADDRS=node1=10.9.0.1,node2=10.9.0.2" in ranks_env
    assert {"MASTER_ADDR=10.9.0.1", "MASTER_PORT=20077"} <= set(ranks_env)


def test_the_offline_image_holds_what_the_dockerfile_copies_where_the_sbatch_files_look():
    from tests.unit.test_render_containers import instructions
    from workflows import jobs

    text = (REPO / "containers" / "build-offline.sh").read_text()
    packaged = re.search(r"^PACKAGE_PATHS=\((.*)\)$", text, re.M).group(1).split()
    copied = [source for instruction, arguments in instructions() if instruction == "COPY"
              for source in shlex.split(arguments)[:-1]]
    assert sorted(packaged) == sorted(copied)
    assert re.search(rf"^WORKDIR_IN_IMAGE={re.escape(jobs.CONTAINER_WORKDIR)}\s", text, re.M)
