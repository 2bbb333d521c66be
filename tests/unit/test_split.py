"""--split's deterministic sample assignment (trainer/data/split.py) and the --eval-* flag rules."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.data.split import SampleSplit, parse_split

BASE = ["--mock-data", "--global-batch-size", "8"]


def test_weights_are_read_like_megatron_and_reduced_to_small_integers() -> None:
    assert parse_split("969,30,1") == ((969, 30, 1), [])
    assert parse_split("0.969, 0.03, 0.001") == ((969, 30, 1), [])
    assert parse_split("98/2") == ((49, 1, 0), [])
    assert parse_split("90,10,0") == ((9, 1, 0), [])
    for bad in ("", "a,b", "1,2,3,4", "0,0,0", "-1,2,0"):
        assert parse_split(bad)[0] is None and parse_split(bad)[1], bad


def test_shares_are_disjoint_exact_per_block_and_in_order() -> None:
    split = SampleSplit((8, 1, 1))
    train = [split.index("train", k) for k in range(80)]
    valid = [split.index("valid", k) for k in range(10)]
    test = [split.index("test", k) for k in range(10)]
    assert sorted(train + valid + test) == list(range(100))
    assert train[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 10] and valid[:2] == [8, 18] and test[:2] == [9, 19]
    assert split.span("valid", 2) == 19 and split.span("train", 0) == 0
    assert SampleSplit.parse(None).index("train", 123) == 123  # no --split: every sample trains
    with pytest.raises(ValueError, match="valid split no samples"):
        SampleSplit((1, 0, 0)).index("valid", 0)


def test_eval_flags_and_the_effective_split() -> None:
    cfg = parse_config(BASE + ["--eval-interval", "5", "--eval-iters", "2"], 1)
    assert cfg.validates and cfg.sample_split == "969,30,1"  # Megatron-LM's default split
    assert parse_config(BASE, 1).sample_split is None
    assert not parse_config(BASE + ["--eval-interval", "5", "--eval-iters", "0"], 1).validates
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--eval-interval", "0", "--eval-iters", "-1", "--split", "x"], 1)
    text = str(err.value)
    assert "--eval-interval=0 must be >= 1" in text and "--eval-iters=-1 must be >= 0" in text
    assert "--split='x'" in text
    with pytest.raises(ConfigError, match="gives the valid share 0"):
        parse_config(BASE + ["--eval-interval", "2", "--split", "99,0,1"], 1)
