"""PNG timeline of one iteration: one row per stage, F/B/I/W boxes labelled with their microbatch.

Time runs from the iteration's first compute start (0 ms) so a measured and a simulated schedule,
drawn as two panels on one shared axis (``--compare``), line up at their step start. Sends and
receives, when traced, are thin bars under each row: they show whether communication overlaps
compute. Matplotlib's Agg backend renders without a display (compute nodes have none).

Legibility: the picture widens (within FIGURE_WIDTH_IN) until 90% of the boxes can hold their
label; each panel then uses one font size, the largest at which 90% of its labels fit; a label
that would spill over its neighbours is left out rather than drawn illegibly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from trainer.profiling.validate import COMPUTE_CATEGORIES

COLOURS = MappingProxyType({"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"})
"""Forward blue, backward green; split backward: input-grad orange, weight-grad purple."""
COMM_COLOURS = MappingProxyType({"send": "#C44E52", "recv": "#937860"})
FIGURE_WIDTH_IN = (16.0, 30.0)
"""Narrowest and widest picture (inches)."""
AXES_SHARE = 0.85
"""Share of the figure width the time axis gets (the rest: stage names and margins)."""
LABEL_POINTS = (6.0, 9.0)
"""Smallest and largest label font size (points)."""
CHAR_WIDTH_EM = 0.65
"""Width of a bold digit in em, for fitting labels into boxes (plus 0.6 em of margin)."""
DPI = 110


@dataclass
class Panel:
    """One iteration of one trace, ready to draw."""

    title: str
    row_names: list[str]
    """Row labels, top row first (stage 0 on top, as pipeline diagrams are drawn)."""
    rows: list[list[dict[str, Any]]]
    """Events of each row; ``ts`` already relative to the step start, in µs."""
    chunks: int

    @property
    def compute(self) -> list[tuple[int, dict[str, Any]]]:
        return [(r, e) for r, events in enumerate(self.rows) for e in events if e["cat"] in COMPUTE_CATEGORIES]

    @property
    def span_ms(self) -> float:
        return max((e["ts"] + e["dur"]) / 1000.0 for events in self.rows for e in events)


def _label(event: dict[str, Any], chunks: int) -> str:
    """Microbatch id, with the chunk when there are several: "3" or "3.1"."""
    args = event["args"]
    return str(args["microbatch"]) + (f".{args['chunk']}" if chunks > 1 else "")


def _text_points(text: str, size: float) -> float:
    return size * (CHAR_WIDTH_EM * len(text) + 0.6)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def make_panel(merged: dict[str, Any], iteration: int, kind: str) -> Panel:
    """The rows of ``iteration`` in ``merged``, times relative to its first compute start."""
    from trainer.profiling.summary import summarize

    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in merged["traceEvents"]:
        if e.get("ph") == "X" and e["args"].get("iteration") == iteration:
            by_pid[e["pid"]].append(e)
    starts = [e["ts"] for events in by_pid.values() for e in events if e["cat"] in COMPUTE_CATEGORIES]
    if not starts:
        raise ValueError(f"iteration {iteration} has no compute events to draw")
    origin = min(starts)
    summary = summarize(merged, iteration)
    meta = merged.get("metadata") or {}
    title = (f"{kind}: {meta.get('schedule', '?')}, PP={summary.pipeline_parallel} M={summary.num_microbatches} "
             f"v={summary.num_chunks}, iteration {iteration}: {summary.mean_iteration_time_ms:.1f} ms, "
             f"bubble {summary.bubble_fraction:.1%}")
    pids = sorted(by_pid)
    return Panel(title=title, row_names=[names.get(pid, f"pid {pid}") for pid in pids],
                 rows=[[dict(e, ts=e["ts"] - origin) for e in by_pid[pid]] for pid in pids],
                 chunks=int(meta.get("num_chunks", 1)))


def _figure_width(panels: list[Panel], span_ms: float) -> float:
    """Inches at which 90% of the compute boxes hold their label at the smallest font size,
    within FIGURE_WIDTH_IN."""
    needs = [_text_points(_label(e, p.chunks), LABEL_POINTS[0]) / max(e["dur"] / 1000.0, 1e-9)
             for p in panels for _, e in p.compute]  # points per ms each box needs
    wanted = _quantile(needs, 0.9) * span_ms / 72.0 / AXES_SHARE
    return min(max(wanted, FIGURE_WIDTH_IN[0]), FIGURE_WIDTH_IN[1])


def _draw_panel(ax, panel: Panel, points_per_ms: float, span_ms: float) -> None:
    top = len(panel.rows) - 1
    fits = [e["dur"] / 1000.0 * points_per_ms / _text_points(_label(e, panel.chunks), 1.0)
            for _, e in panel.compute]
    size = min(max(_quantile(fits, 0.1), LABEL_POINTS[0]), LABEL_POINTS[1])
    for row, e in panel.compute:
        y, start, width = top - row, e["ts"] / 1000.0, e["dur"] / 1000.0
        ax.broken_barh([(start, width)], (y - 0.4, 0.7), facecolors=COLOURS[e["cat"]],
                       edgecolor="white", linewidth=0.5)
        text = _label(e, panel.chunks)
        if _text_points(text, size) <= width * points_per_ms:
            ax.text(start + width / 2, y - 0.05, text, ha="center", va="center", fontsize=size,
                    color="white", fontweight="bold")
    for row, events in enumerate(panel.rows):
        for e in events:
            if e["cat"] in COMM_COLOURS:  # zero-length transfers still get a visible tick
                ax.broken_barh([(e["ts"] / 1000.0, max(e["dur"] / 1000.0, span_ms * 1e-3))],
                               (top - row - 0.48, 0.06), facecolors=COMM_COLOURS[e["cat"]])
            elif e["cat"] == "gpu":  # when the GPU ran the op (CUDA events): a strip above the host box
                ax.broken_barh([(e["ts"] / 1000.0, e["dur"] / 1000.0)], (top - row + 0.33, 0.1),
                               facecolors=COLOURS.get(e["args"].get("op", "F"), "#444444"))
    ax.set_yticks(range(len(panel.rows)))
    ax.set_yticklabels(list(reversed(panel.row_names)))
    ax.set_ylim(-0.6, len(panel.rows) - 0.4)
    ax.set_title(panel.title, loc="left", fontsize=11)
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(merged: dict[str, Any], path: str | Path, iteration: int,
                  compare: dict[str, Any] | None = None, compare_iteration: int | None = None) -> Path:
    """Writes the PNG of ``iteration`` (and, below it, ``compare``'s ``compare_iteration``)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes; set before pyplot is imported
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kind = "simulated" if (merged.get("metadata") or {}).get("source") == "simulator" else "measured"
    panels = [make_panel(merged, iteration, kind)]
    if compare is not None:
        panels.append(make_panel(compare, iteration if compare_iteration is None else compare_iteration,
                                 "simulated"))
    span_ms = max(p.span_ms for p in panels)
    width_in = _figure_width(panels, span_ms)
    heights = [len(p.rows) * 0.55 + 0.9 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, sum(heights) + 0.8), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, panel, width_in * 72.0 * AXES_SHARE / span_ms, span_ms)
    axes[-1, 0].set_xlim(0, span_ms * 1.01)
    axes[-1, 0].set_xlabel("time since step start (ms)")
    used = {e["cat"] for p in panels for events in p.rows for e in events}
    handles = [Patch(color=c, label=n) for n, c in {**COLOURS, **COMM_COLOURS}.items() if n in used]
    # Above the top panel, right of its left-aligned title, so it never hides a box.
    axes[0, 0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
                      fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
