"""Which transformer layers each pipeline stage and model chunk holds (pure, no torch).

Megatron-LM's uneven split: ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``
(megatron-core ``TransformerConfig.num_layers_in_first_pipeline_stage`` / ``..._last_...``, present in
0.16 and 0.19) give the first / last stage F / L layers and spread the rest evenly over the middle
stages. A stage carrying the embedding or the output head over a 50k vocabulary does more work than
its layers say (the head weighs about two layers at hidden 2048), so e.g. 16 layers on 4 stages run
faster as 5/4/4/3 than 4/4/4/4 (docs/benchmarks.md#reference-megatron-core-alone-on-4-h200s).

:func:`split_problems` states megatron-core's rules (``TransformerConfig.__post_init__`` and
``get_num_layers_to_build``) as messages naming the flags; :func:`stage_layers` reproduces
``get_transformer_layer_offset`` so a rank, a test or a log line knows the global layer indices of
every chunk without building a model. With VP, chunk ``c`` of stage ``s`` holds layers
``[c*T + offset(s), ...)`` where ``T`` is the layers per "virtual round" -- megatron-core's own
interleaved order, which tests/unit/test_layer_split.py checks against the installed package.
"""

from __future__ import annotations

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


def split_problems(num_layers: int, pp: int, vp: int, first: int | None, last: int | None) -> list[str]:
    """Every way the uneven split cannot be laid out (empty list: it can, or the split is even)."""
    if first is None and last is None:
        return []
    p: list[str] = []
    given = {FIRST_FLAG: first, LAST_FLAG: last}
    for flag, value in given.items():
        if value is not None and value < 1:
            p.append(f"{flag}={value} must be >= 1")
    if pp < 2:
        p.append(f"{FIRST_FLAG} / {LAST_FLAG} need --pipeline-model-parallel-size > 1 (got {pp})")
    if p:
        return p
    for flag, value in given.items():
        if value is not None and vp > 1 and value % vp:
            p.append(f"{flag}={value} is not divisible by the {vp} virtual stages per pipeline rank")
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    named = " + ".join(f"{flag}={value}" for flag, value in given.items() if value is not None)
    if middle_layers < 0:
        p.append(f"{named} is more than --num-layers={num_layers}")
    elif bool(middle_layers) != bool(middle_stages):
        p.append(f"--num-layers={num_layers} minus {named} leaves {middle_layers} layers for "
                 f"{middle_stages} middle stages of --pipeline-model-parallel-size={pp}")
    elif middle_stages and middle_layers % middle_stages:
        p.append(f"the {middle_layers} layers left after {named} are not divisible by the "
                 f"{middle_stages} middle stages of --pipeline-model-parallel-size={pp}")
    elif middle_stages and vp > 1 and (middle_layers // middle_stages) % vp:
        p.append(f"{middle_layers // middle_stages} layers per middle stage (after {named}) are not "
                 f"divisible by the {vp} virtual stages per pipeline rank")
    return p


def layers_per_stage(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Transformer layers on each pipeline stage (all chunks together); assumes no split_problems."""
    middle_stages = pp - (first is not None) - (last is not None)
    middle = (num_layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(num_layers: int, pp: int, vp: int = 1, first: int | None = None,
                 last: int | None = None) -> list[list[list[int]]]:
    """``[stage][chunk] -> global 0-based layer indices``, megatron-core's placement."""
    counts = layers_per_stage(num_layers, pp, first, last)
    per_chunk = [n // vp for n in counts]
    round_size = sum(per_chunk)  # layers in one virtual round (chunk c of every stage)
    out = []
    for s in range(pp):
        offset = sum(per_chunk[:s])
        out.append([list(range(c * round_size + offset, c * round_size + offset + per_chunk[s]))
                    for c in range(vp)])
    return out


def describe_split(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> str:
    """``"5/4/4/3"``: layers per stage, for logs and reports."""
    return "/".join(map(str, layers_per_stage(num_layers, pp, first, last)))
