"""PNG timeline of one iteration: one row per stage, F/B/I/W boxes labelled with their microbatch.

Time runs from the iteration's first compute start (0 ms) so a measured and a simulated schedule,
drawn as two panels on one shared axis (``--compare``), line up at their step start. Sends and
receives, when traced, are thin bars under each row: they show whether communication overlaps
compute. Matplotlib's Agg backend renders without a display (compute nodes have none).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from trainer.profiling.validate import COMPUTE_CATEGORIES

COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
"""Forward blue, backward green; split backward: input-grad orange, weight-grad purple."""
COMM_COLOURS = {"send": "#C44E52", "recv": "#937860"}
FIGURE_WIDTH_IN = 16.0
MIN_LABEL_POINTS = 9.0
"""Boxes narrower than this many points carry no label (it would spill over its neighbours)."""


def _iteration_rows(merged: dict[str, Any], iteration: int) -> tuple[dict[int, str], dict[int, list[dict]], float]:
    """Row label and events per pid for ``iteration``, and the iteration's first compute start."""
    labels = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows: dict[int, list[dict]] = defaultdict(list)
    for e in merged["traceEvents"]:
        if e.get("ph") == "X" and e["args"].get("iteration") == iteration:
            rows[e["pid"]].append(e)
    starts = [e["ts"] for events in rows.values() for e in events if e["cat"] in COMPUTE_CATEGORIES]
    if not starts:
        raise ValueError(f"iteration {iteration} has no compute events to draw")
    return {pid: labels.get(pid, f"pid {pid}") for pid in rows}, rows, min(starts)


def _draw_panel(ax, merged: dict[str, Any], iteration: int, title: str, span_ms: float) -> None:
    labels, rows, origin = _iteration_rows(merged, iteration)
    chunks = int((merged.get("metadata") or {}).get("num_chunks", 1))
    points_per_ms = FIGURE_WIDTH_IN * 72.0 * 0.85 / span_ms  # ~85% of the figure is the axes
    pids = sorted(rows)
    for row, pid in enumerate(pids):
        y = len(pids) - 1 - row  # stage 0 on top, as pipeline diagrams are drawn
        for e in rows[pid]:
            start, width = (e["ts"] - origin) / 1000.0, e["dur"] / 1000.0
            if e["cat"] in COMPUTE_CATEGORIES:
                ax.broken_barh([(start, width)], (y - 0.4, 0.7), facecolors=COLOURS[e["cat"]],
                               edgecolor="white", linewidth=0.5)
                text = str(e["args"]["microbatch"]) + (f".{e['args']['chunk']}" if chunks > 1 else "")
                box_points = width * points_per_ms
                if box_points >= MIN_LABEL_POINTS:
                    size = min(9.0, box_points / (0.65 * len(text) + 0.6))
                    ax.text(start + width / 2, y - 0.05, text, ha="center", va="center",
                            fontsize=size, color="white", fontweight="bold")
            elif e["cat"] in COMM_COLOURS:
                ax.broken_barh([(start, max(width, span_ms * 1e-3))], (y - 0.48, 0.06),
                               facecolors=COMM_COLOURS[e["cat"]])
    ax.set_yticks(range(len(pids)))
    ax.set_yticklabels([labels[pid] for pid in reversed(pids)])
    ax.set_ylim(-0.6, len(pids) - 0.4)
    ax.set_title(title, loc="left", fontsize=11)
    ax.grid(axis="x", alpha=0.3)


def _panel_title(merged: dict[str, Any], iteration: int, kind: str) -> str:
    from trainer.profiling.summary import summarize

    summary = summarize(merged, iteration)
    meta = merged.get("metadata") or {}
    return (f"{kind}: {meta.get('schedule', '?')}, PP={summary.pipeline_parallel} M={summary.num_microbatches} "
            f"v={summary.num_chunks}, iteration {iteration}: {summary.mean_iteration_time_ms:.1f} ms, "
            f"bubble {summary.bubble_fraction:.1%}")


def _step_span_ms(merged: dict[str, Any], iteration: int) -> float:
    _, rows, origin = _iteration_rows(merged, iteration)
    return max((e["ts"] + e["dur"] - origin) / 1000.0 for events in rows.values() for e in events)


def plot_timeline(merged: dict[str, Any], path: str | Path, iteration: int,
                  compare: dict[str, Any] | None = None, compare_iteration: int | None = None) -> Path:
    """Writes the PNG of ``iteration`` (and, below it, ``compare``'s ``compare_iteration``)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes; set before pyplot is imported
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(merged, iteration, "measured" if (merged.get("metadata") or {}).get("source") != "simulator"
               else "simulated")]
    if compare is not None:
        panels.append((compare, compare_iteration if compare_iteration is not None else iteration, "simulated"))
    span_ms = max(_step_span_ms(doc, it) for doc, it, _ in panels)
    heights = [max(len(_iteration_rows(doc, it)[1]), 1) * 0.55 + 0.9 for doc, it, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(FIGURE_WIDTH_IN, sum(heights) + 0.8), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (doc, it, kind) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, doc, it, _panel_title(doc, it, kind), span_ms)
    axes[-1, 0].set_xlim(0, span_ms * 1.01)
    axes[-1, 0].set_xlabel("time since step start (ms)")
    used = {e["cat"] for doc, _, _ in panels for e in doc["traceEvents"] if e.get("ph") == "X"}
    handles = [Patch(color=c, label=n) for n, c in {**COLOURS, **COMM_COLOURS}.items() if n in used]
    # Above the top panel, right of its left-aligned title, so it never hides a box.
    axes[0, 0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
                      fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
