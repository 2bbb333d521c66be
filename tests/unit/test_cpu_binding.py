"""trainer.launch.cpu_binding: the pure CPU-set plan of the benchmark launcher's ``--cpu-bind numa``, and the
launcher really applying it to a started rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer.launch.cpu_binding import _sysfs_bus_id, format_cpu_list, parse_cpu_list, plan_cpu_sets
from trainer.launch.local_ranks import start_ranks


def test_cpu_list_round_trip() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 10, 8, 3, 2, 1, 0]) == "0-3,8,10-11"
    assert parse_cpu_list("") == []


def test_nvidia_bus_id_maps_to_sysfs_name() -> None:
    assert _sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"


def test_two_nodes_four_gpus_each_rank_gets_a_slice_of_its_gpus_node() -> None:
    nodes = {0: list(range(0, 32)), 1: list(range(32, 64))}
    sets = plan_cpu_sets(4, range(64), [0, 0, 1, 1], nodes)
    assert sets == [list(range(0, 16)), list(range(16, 32)), list(range(32, 48)), list(range(48, 64))]


def test_unknown_numa_node_splits_the_allowed_cpus_evenly_and_disjointly() -> None:
    sets = plan_cpu_sets(4, range(16), [None] * 4, {0: list(range(16))})
    assert sets == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_only_allowed_cpus_are_used() -> None:
    nodes = {0: list(range(0, 8)), 1: list(range(8, 16))}
    sets = plan_cpu_sets(2, [0, 1, 2, 9, 10, 11], [0, 1], nodes)
    assert sets == [[0, 1, 2], [9, 10, 11]]


def test_mixed_known_and_unknown_nodes_do_not_overlap() -> None:
    nodes = {0: list(range(0, 8)), 1: list(range(8, 16))}
    sets = plan_cpu_sets(3, range(16), [0, None, 0], nodes)
    assert sets[0] == [0, 1, 2, 3] and sets[2] == [4, 5, 6, 7]
    assert sets[1] == list(range(8, 16))  # the CPUs no known node of these ranks claimed


def test_node_with_too_few_cpus_falls_back_to_the_even_split() -> None:
    sets = plan_cpu_sets(2, range(4), [0, 0], {0: [0], 1: [1, 2, 3]})
    assert sets is not None and all(sets) and not set(sets[0]) & set(sets[1])


def test_fewer_cpus_than_ranks_means_no_binding() -> None:
    assert plan_cpu_sets(4, [0, 1], [None] * 4, {}) is None


def test_numa_list_must_match_ranks() -> None:
    with pytest.raises(ValueError, match="3 entries for 2 ranks"):
        plan_cpu_sets(2, range(8), [0, 0, 0], {0: list(range(8))})


def test_launcher_applies_the_cpu_set_before_the_rank_starts(tmp_path: Path) -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    ranks = start_ranks(["tests.unit.print_affinity"], 1, tmp_path, run_id="t", cpu_sets=[[cpu]],
                        cwd=Path(__file__).resolve().parents[2])
    assert not ranks.wait(60)
    out = ranks.output(0)
    assert f"bound to CPUs {cpu}" in out and f"affinity [{cpu}]" in out, out
    assert ranks.procs[0].returncode == 0, out
