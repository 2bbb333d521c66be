"""The 4-GPU tier calls (scripts/device/call_4gpu_tier.sh) run the GPU tests group by group, as
scripts/device/gpu_tier_groups.py lists them. CI has no GPU and deselects every ``gpu`` test, so a
GPU test that no group names would never run anywhere: this holds the groups to what pytest collects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "device"))

from gpu_tier_groups import GROUPS, PARTS  # noqa: E402


def _collected_gpu_tests() -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def _covers(entry: str, test_id: str) -> bool:
    return test_id == entry or test_id.startswith(entry + "::") or test_id.startswith(entry + "[")


def test_every_gpu_test_is_in_exactly_one_group_of_the_tier_calls() -> None:
    collected = _collected_gpu_tests()
    assert len(collected) >= 20, sorted(collected)  # tests/gpu alone has 21
    entries = [(name, e) for name, group in GROUPS.items() for e in group]
    owners = {t: [name for name, e in entries if _covers(e, t)] for t in collected}
    orphans = sorted(t for t, names in owners.items() if not names)
    doubles = {t: names for t, names in owners.items() if len(names) > 1}
    assert not orphans, f"GPU tests no tier group runs (add them to scripts/device/gpu_tier_groups.py): {orphans}"
    assert not doubles, f"GPU tests run by more than one group: {doubles}"
    stale = sorted(e for _, e in entries if not any(_covers(e, t) for t in collected))
    assert not stale, f"tier groups name tests pytest does not collect: {stale}"


def test_every_group_is_in_one_part_and_every_part_fits_one_device_call() -> None:
    used = [g for pairs, last, _, _ in PARTS.values() for g in (*pairs, last)]
    assert sorted(used) == sorted(GROUPS) and len(used) == len(set(used))
    for part, (pairs, _, pair_s, last_s) in PARTS.items():
        assert len(pairs) in (0, 2), part  # two GPU pairs side by side, or none
        assert pair_s + last_s <= 580, f"part {part}: {pair_s} + {last_s} s leaves no room under the 600-s call limit"
