"""Benchmark layouts: ``PPxTPxDP`` with Megatron-LM's data- and tensor-parallel options, one table each.

``--layouts 4x1x1,2x2x1+sp,2x1x2+overlap+distopt`` runs the benchmark's lines once per layout, so one
call compares, per layout, megatron-core's best eager configuration of that layout with the DPP
default on the same model and data. ``+sp`` is ``--sequence-parallel`` (needs TP > 1), ``+overlap``
``--overlap-grad-reduce`` and ``+distopt`` ``--use-distributed-optimizer`` (both need DP > 1 to mean
anything, and are refused without it). The global batch is M x mbs x DP: every replica runs the same
M microbatches, so the per-GPU work of a layout does not depend on its DP. ``@NAME`` after a layout
(``4x1x1@bert16-h2048``) runs it on that benchmark model of trainer/bench/experiments.py instead of the
call's model flags (its own sizes, micro-batches, iterations and balanced split), so one call holds a
table per model too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.bench.experiments import MODELS

OPTIONS = {"sp": "--sequence-parallel", "overlap": "--overlap-grad-reduce", "distopt": "--use-distributed-optimizer"}
_FORM = re.compile(r"^(?P<pp>[1-9][0-9]*)x(?P<tp>[1-9][0-9]*)x(?P<dp>[1-9][0-9]*)(?P<opts>(\+[a-z]+)*)"
                   r"(@(?P<model>[A-Za-z0-9._-]+))?$")


@dataclass(frozen=True)
class Layout:
    """One parallel layout of the benchmark's model."""

    pipeline_parallel: int
    tensor_parallel: int = 1
    data_parallel: int = 1
    options: tuple[str, ...] = ()
    """Keys of :data:`OPTIONS`, in the order given."""
    model: str = ""
    """A model of trainer.bench.experiments.MODELS (``@NAME``); "": the call's model flags."""

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel * self.tensor_parallel * self.data_parallel

    @property
    def label(self) -> str:
        """``pp4xtp1xdp1``, the options and the model (``pp4xtp1xdp1-bert16-h2048``), as the report's section
        titles and the line folders name it: "-" before the model, not "@", so file names keep to
        [A-Za-z0-9._-] once the options' "+" is spelt "-"."""
        base = f"pp{self.pipeline_parallel}xtp{self.tensor_parallel}xdp{self.data_parallel}"
        return base + "".join(f"+{o}" for o in self.options) + (f"-{self.model}" if self.model else "")

    def trainer_args(self) -> list[str]:
        """Trainer flags of this layout beyond --pipeline-model-parallel-size (which every line has)."""
        args = ["--tensor-model-parallel-size", str(self.tensor_parallel)] if self.tensor_parallel > 1 else []
        return args + [OPTIONS[o] for o in self.options]

    def describe(self) -> str:
        flags = " ".join(OPTIONS[o] for o in self.options)
        return (f"PP={self.pipeline_parallel} x TP={self.tensor_parallel} x DP={self.data_parallel} "
                f"({self.world_size} ranks)" + (f", {flags}" if flags else ""))


def parse_layouts(text: str) -> tuple[list[Layout], list[str]]:
    """(layouts, problems) of a ``--layouts`` value; an empty value gives no layouts and no problem."""
    layouts, problems = [], []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        match = _FORM.match(item)
        if not match:
            problems.append(f"--layouts: {item!r} is not PPxTPxDP[+sp][+overlap][+distopt][@MODEL] "
                            "(e.g. 2x2x1+sp, 4x1x1@bert16-h2048)")
            continue
        options = tuple(o for o in match["opts"].split("+") if o)
        unknown = [o for o in options if o not in OPTIONS]
        model = match["model"] or ""
        layout = Layout(int(match["pp"]), int(match["tp"]), int(match["dp"]), options, model)
        if unknown:
            problems.append(f"--layouts: {item!r}: unknown option(s) {', '.join(unknown)} "
                            f"(known: {', '.join(OPTIONS)})")
        if model and model not in MODELS:
            problems.append(f"--layouts: {item!r}: unknown model {model!r} (known: {', '.join(MODELS)})")
        if "sp" in options and layout.tensor_parallel < 2:
            problems.append(f"--layouts: {item!r}: +sp (--sequence-parallel) needs TP > 1")
        if "sp" in options and model in MODELS and MODELS[model].model != "gpt":
            # The trainer's own check (trainer/config/layout.py), named here before any line starts.
            problems.append(f"--layouts: {item!r}: +sp (--sequence-parallel) is implemented for GPT only; "
                            f"{model} is {MODELS[model].model.upper()}")
        for option in ("overlap", "distopt"):
            if option in options and layout.data_parallel < 2:
                problems.append(f"--layouts: {item!r}: +{option} ({OPTIONS[option]}) needs DP > 1")
        if layout.pipeline_parallel < 2:
            problems.append(f"--layouts: {item!r}: the benchmark compares pipeline schedules: PP must be >= 2")
        if not unknown and (not model or model in MODELS):
            layouts.append(layout)
    labels = [lay.label for lay in layouts]
    problems += [f"--layouts: {label} given twice" for label in sorted({x for x in labels if labels.count(x) > 1})]
    return layouts, problems
