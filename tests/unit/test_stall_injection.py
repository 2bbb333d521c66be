"""trainer.schedule.stall_injection: the same seed delays the same forward ops whatever order a schedule runs them in."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.schedule.stall_injection import StallInjector, StallSpec, parse_stall_spec, stall_problems


def _run(order: list[tuple[int, int]], spec: StallSpec, iterations: int = 3) -> list[tuple[int, int, int]]:
    """Drive the wrapped forward step in ``order`` of (chunk, microbatch); returns the delayed ops."""
    chunks = [object(), object()]
    slept: list[float] = []
    injector = StallInjector(spec, chunks, sleep=slept.append)
    seen: list[tuple[int, int]] = []
    step = injector.wrap(lambda it, model: seen.append(next(it)))
    for iteration in range(iterations):
        injector.set_iteration(iteration)
        for chunk, microbatch in order:
            step(iter([(chunk, microbatch)]), chunks[chunk])
    assert seen == [op for _ in range(iterations) for op in order]  # the step itself still runs
    assert slept == [spec.milliseconds] * len(injector.delayed)
    return sorted(injector.delayed)


def test_same_seed_same_ops_for_any_execution_order() -> None:
    spec = StallSpec(rank=1, fraction=0.25, milliseconds=7.0, seed=42)
    m = 32
    # interleaved-like: chunks alternate in groups; breadth-first: all of chunk 0 first
    grouped = [(c, g * 4 + i) for g in range(m // 4) for c in (0, 1) for i in range(4)]
    breadth = [(c, i) for c in (0, 1) for i in range(m)]
    delayed = _run(grouped, spec)
    assert delayed == _run(breadth, spec)
    assert 0.1 < len(delayed) / (3 * 2 * m) < 0.4  # about FRACTION of the ops
    assert delayed != _run(breadth, StallSpec(1, 0.25, 7.0, seed=43))


def test_fraction_bounds() -> None:
    assert _run([(0, i) for i in range(16)], StallSpec(0, 0.0, 1.0)) == []
    assert len(_run([(0, i) for i in range(16)], StallSpec(0, 1.0, 1.0))) == 3 * 16


def test_parse_and_every_problem_named() -> None:
    assert parse_stall_spec("3:0.05:20") == StallSpec(3, 0.05, 20.0, 0)
    assert parse_stall_spec("0:1:2.5:9") == StallSpec(0, 1.0, 2.5, 9)
    problems = stall_problems("-1:1.5:-3")
    assert len(problems) == 3 and "RANK=-1" in problems[0] and "FRACTION=1.5" in problems[1]
    assert "MILLISECONDS=-3.0" in problems[2]
    assert "RANK:FRACTION:MILLISECONDS[:SEED]" in stall_problems("1:2")[0]
    assert "SEED='x' is not an integer" in stall_problems("1:0.1:2:x")[0]
    with pytest.raises(ValueError, match="FRACTION"):
        parse_stall_spec("0:2:1")


def test_flag_is_validated_with_the_rest_of_the_configuration() -> None:
    base = ["--mock-data", "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--device", "cpu"]
    assert parse_config(base + ["--inject-stalls", "1:0.05:20:7"], world_size=2).run.inject_stalls == "1:0.05:20:7"
    with pytest.raises(ConfigError) as err:
        parse_config(base + ["--inject-stalls", "1:2:1", "--log-interval", "0"], world_size=2)
    assert len(err.value.problems) == 2 and "FRACTION=2.0" in str(err.value)
    with pytest.raises(ConfigError, match="--inject-stalls='5:0.5:1' names rank 5 but the world size is 2"):
        parse_config(base + ["--inject-stalls", "5:0.5:1"], world_size=2)
