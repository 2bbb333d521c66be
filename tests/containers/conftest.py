"""The containers tier: the chain inside enroot images through Pyxis, on the project's local cluster.

It runs only where enroot and Pyxis are installed (scripts/install-enroot-pyxis.sh), the cluster has
Pyxis registered (scripts/cluster.sh plugstack) and an image exists (containers/build-offline.sh,
or MDPP_TEST_IMAGE); anywhere else — CI's clean clone among them — every test here is skipped with
the reason, before any cluster is started. Every test here is marked `containers` and `slurm`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# The slurm tier's session fixture (cluster up, SLURM_CONF exported) and its submit/wait helper.
from tests.slurm.conftest import CLUSTER_DIR, Slurm, slurm_cluster  # noqa: F401 - fixtures used here

REPO = Path(__file__).resolve().parents[2]
IMAGE = Path(os.environ.get("MDPP_TEST_IMAGE") or REPO / "build" / "megatron-dpp-cpu.sqsh")
PYXIS_PLUGIN = Path(os.environ.get("PYXIS_PLUGIN", "/usr/local/lib/slurm/spank_pyxis.so"))


def missing() -> list[str]:
    """What this machine lacks for the tier, each with how to get it (empty: the tier runs)."""
    found = []
    if shutil.which("enroot") is None:
        found.append("enroot is not installed (scripts/install-enroot-pyxis.sh --enroot-src DIR --pyxis-src DIR)")
    if not PYXIS_PLUGIN.is_file():
        found.append(f"Pyxis is not installed ({PYXIS_PLUGIN}; scripts/install-enroot-pyxis.sh)")
    if not IMAGE.is_file():
        found.append(f"no image {IMAGE} (containers/build-offline.sh, or set MDPP_TEST_IMAGE)")
    return found


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    lacking = missing()
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.containers)
            item.add_marker(pytest.mark.slurm)
            if lacking:
                item.add_marker(pytest.mark.skip(reason="containers tier skipped: " + "; ".join(lacking)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """item.passed: whether the test body passed (runs_dir keeps a failed chain's folder)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.passed = report.passed


@pytest.fixture
def slurm(tmp_path: Path) -> Slurm:
    return Slurm(tmp_path)
