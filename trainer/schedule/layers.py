"""Layer costs and the balanced layer split: owned by :mod:`trainer.layer_split` (every split rule and
the one :func:`balanced_split` live there); these names are re-exported for existing imports."""

from trainer.layer_split import LayerCosts, LayerSplit, balanced_split, split_of

__all__ = ["LayerCosts", "LayerSplit", "balanced_split", "split_of"]
