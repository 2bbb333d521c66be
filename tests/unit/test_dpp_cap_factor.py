"""--dpp-cap-factor: each stage's 1F1B in-flight cap times a factor, rounded down, for the DPP runtime.

Measured (docs/benchmarks.md, 4xH100, PP=4): with CUDA graphs, 1.5 (6/4/3/1) hides the stage-to-stage
round trip that holds 1F1B's caps (4/3/2/1) back; these tests pin what the flag means and refuses.
"""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.schedule.core import PipelineShape
from trainer.schedule.registry import make_policy
from trainer.train import link_options

PP4 = ["--device", "cpu", "--mock-data", "--num-layers", "8", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
       "--global-batch-size", "32", "--pipeline-model-parallel-size", "4", "--use-dpp"]


@pytest.mark.parametrize("factor, caps", [("1", [4, 3, 2, 1]), ("1.25", [5, 3, 2, 1]), ("1.5", [6, 4, 3, 1]),
                                          ("2", [8, 6, 4, 2])])
def test_caps_are_each_stage_s_1f1b_cap_times_the_factor(factor: str, caps: list[int]) -> None:
    cfg = parse_config(PP4 + ["--dpp-cap-factor", factor], world_size=4)
    shape = PipelineShape(4, 32, 1)
    got = [make_policy("dpp", shape, s, max_inflight=cfg.parallel.dpp_max_inflight,
                       cap_factor=cfg.parallel.dpp_cap_factor).cap for s in range(4)]
    assert got == caps
    # Every edge has credits for the largest cap, so a send never waits on a credit the policy withholds.
    assert link_options(cfg, shape).credits >= caps[0]


@pytest.mark.parametrize("extra, needle", [
    (["--dpp-cap-factor", "0.5"], "--dpp-cap-factor=0.5 must be a finite number >= 1"),
    (["--dpp-cap-factor", "nan"], "--dpp-cap-factor=nan must be a finite number >= 1"),
    (["--dpp-cap-factor", "1.5", "--dpp-max-inflight", "3"], "give one"),
    (["--dpp-cap-factor", "1.5", "--dpp-policy", "zb-h1"], "applies to --use-dpp with --dpp-policy dpp/dpp-zb"),
])
def test_bad_factors_are_refused_naming_the_value(extra: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(PP4 + extra, world_size=4)
    assert needle in str(err.value)


def test_factor_without_dpp_is_refused() -> None:
    with pytest.raises(ConfigError, match="applies to --use-dpp"):
        parse_config([a for a in PP4 if a != "--use-dpp"] + ["--dpp-cap-factor", "1.5"], world_size=4)
