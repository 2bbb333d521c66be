"""The model part of a test's training command line, written once: where it runs and the model's sizes.

Tests of every tier train small megatron-core models. A test names only the sizes that differ from the
tiny CPU model below (2 layers, hidden 32, 4 heads, 16 tokens, vocabulary 128) and appends its own
batch, schedule and run flags. The flags are Megatron-LM's; the trainer's parser does not depend on
their order.
"""

from __future__ import annotations

__all__ = ["GPU_SMALL", "model_flags"]

GPU_SMALL = {"device": "cuda", "layers": 4, "hidden": 256, "seq": 128, "max_position": 128, "vocab": 1000}
"""The GPU tier's small GPT (``model_flags(**GPU_SMALL)``): big enough that a CUDA graph replays real
kernels, small enough that a test's two runs (eager and graphed) take seconds."""


def model_flags(*, layers: int | None = 2, hidden: int = 32, heads: int = 4, seq: int = 16,
                vocab: int | None = 128, max_position: int | None = None, device: str = "cpu",
                mock_data: bool = True, model: str | None = None) -> list[str]:
    """``--device``, ``--mock-data``, ``--model``, then the sizes: ``--num-layers``, ``--hidden-size``,
    ``--num-attention-heads``, ``--seq-length``, ``--max-position-embeddings``, ``--vocab-size``.

    ``None`` leaves a flag out and the trainer's default applies (``--max-position-embeddings`` follows
    ``--seq-length``; the vocabulary is ``--vocab-size``'s default on mock data, the tokenizer's on a
    corpus); ``mock_data=False`` for a command line that reads a corpus (``--data-path``) or has no
    such flag (the benchmark's); ``layers=None`` for one that adds ``--num-layers`` per model.
    """
    flags = ["--device", device]
    if device == "cuda":
        # megatron-core's local layers, named: "auto" picks Transformer Engine's wherever it is installed,
        # and the GPU tests test the local path (tests/gpu/test_te_gpu.py appends its own choice).
        flags += ["--transformer-impl", "local"]
    if mock_data:
        flags.append("--mock-data")
    if model is not None:
        flags += ["--model", model]
    if layers is not None:
        flags += ["--num-layers", str(layers)]
    flags += ["--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--seq-length", str(seq)]
    if max_position is not None:
        flags += ["--max-position-embeddings", str(max_position)]
    if vocab is not None:
        flags += ["--vocab-size", str(vocab)]
    return flags
