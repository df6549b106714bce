"""Pictures of a simulated step: a Chrome / Perfetto trace and a PNG timeline.

* :func:`chrome_trace` / :func:`write_chrome_trace`: the trace-event JSON that
  ``chrome://tracing`` and https://ui.perfetto.dev open. One process per pp rank ("pp rank
  r"), with a "compute" thread (F, B, I, W, UNSHARD, RESHARD, REDUCE_GRAD) and a "p2p"
  thread (SEND_* from issue to arrival, RECV_* while the data arrives), and the rank's memory
  by category as a counter track.
* :func:`write_timeline_png`: one row per rank, actions coloured by kind and labelled with
  stage, kind and microbatch where wide enough, p2p transfers as a thin strip under each
  row; below, each rank's total memory over the step. matplotlib is imported only here,
  drawn on an Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autopp.schedules.sim_result import MEMORY_CATEGORIES, SimulationResult

#: Colour of each action kind in the PNG timeline.
KIND_COLORS: dict[str, str] = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "I": "#C44E52",
    "W": "#55A868",
    "UNSHARD": "#8172B3",
    "RESHARD": "#8C8C8C",
    "REDUCE_GRAD": "#937860",
    "SEND_F": "#9ECAE9",
    "RECV_F": "#C6DBEF",
    "SEND_B": "#FDAE6B",
    "RECV_B": "#FDD0A2",
}
_US = 1e6  # trace timestamps are in microseconds


def chrome_trace(result: SimulationResult) -> dict[str, Any]:
    """The simulated step as Chrome trace-event JSON (a dict ready for ``json.dump``).

    Every action of ``result.events`` is one complete ("X") event: ``pid`` is the pp rank,
    ``tid`` 0 for compute and 1 for p2p, ``name`` torch's action string, ``cat`` its kind.
    Memory is one counter ("C") event per change, per rank, with bytes by category.
    """
    a = result.actions
    events: list[dict[str, Any]] = []
    for r in range(a.pp):
        stages = ", ".join(str(s) for s in a.stage_ids(r))
        events += [
            {"ph": "M", "name": "process_name", "pid": r,
             "args": {"name": f"pp rank {r} (stages {stages})"}},
            {"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}},
            {"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "p2p"}},
        ]
    for e in result.events:
        args: dict[str, Any] = {"stage": e.stage, "microbatch": e.microbatch}
        if e.peer_rank is not None:
            args.update(peer_rank=e.peer_rank, bytes=e.nbytes)
        if e.overlapped:
            args["overlapped"] = True
        events.append({
            "ph": "X", "name": e.action, "cat": e.kind, "pid": e.rank,
            "tid": 1 if e.lane == "comm" else 0,
            "ts": e.start_s * _US, "dur": (e.end_s - e.start_s) * _US, "args": args,
        })
    for timeline in result.memory:
        for i, t in enumerate(timeline.times_s):
            events.append({
                "ph": "C", "name": "memory (bytes)", "pid": timeline.rank, "ts": t * _US,
                "args": {c: timeline.bytes[c][i] for c in MEMORY_CATEGORIES},
            })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": a.name, "pp": a.pp, "n_stages": a.n_stages,
            "n_microbatches": a.n_microbatches, "step_time_s": result.step_time_s,
            "bubble_fraction": result.bubble_fraction,
        },
    }


def write_chrome_trace(result: SimulationResult, path: str | os.PathLike) -> Path:
    """Write :func:`chrome_trace` of ``result`` to ``path`` (JSON); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump(chrome_trace(result), f)
    return path


def _time_unit(step_s: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "us")):
        if step_s * scale >= 1.0:
            return scale, unit
    return 1e9, "ns"


def _byte_unit(peak: float) -> tuple[float, str]:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= div:
            return float(div), unit
    return 1.0, "bytes"


def write_timeline_png(
    result: SimulationResult,
    path: str | os.PathLike,
    *,
    memory: bool = True,
    title: str | None = None,
    width_in: float = 16.0,
    dpi: int = 110,
) -> Path:
    """Draw the simulated step as a PNG timeline; returns the path.

    Args:
        result: what :func:`~autopp.schedules.simulate.simulate` returned.
        path: the PNG file to write (folders are created).
        memory: add a second panel with each rank's total memory over the step.
        title: the figure title; default: schedule, sizes, step time and bubble.
        width_in: figure width in inches (labels appear on actions wide enough for them).
        dpi: resolution.
    """
    # Agg canvas on a bare Figure: no pyplot, no global backend switch, no display needed
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    a = result.actions
    step = result.step_time_s or 1.0
    scale, unit = _time_unit(step)
    row_h = 0.45
    height = 1.2 + a.pp * row_h + (2.2 if memory else 0.0)
    fig = Figure(figsize=(width_in, height), dpi=dpi)
    FigureCanvasAgg(fig)
    if memory:
        grid = fig.add_gridspec(2, 1, height_ratios=[a.pp * row_h + 0.4, 2.0], hspace=0.35)
        ax = fig.add_subplot(grid[0])
        mem_ax = fig.add_subplot(grid[1], sharex=ax)
    else:
        ax = fig.add_subplot(1, 1, 1)
    bars: dict[tuple[int, str, str, bool], list[tuple[float, float]]] = {}
    for e in result.events:
        lane = e.lane
        bars.setdefault((e.rank, e.kind, lane, e.overlapped), []).append(
            (e.start_s * scale, max(e.end_s - e.start_s, step * 1e-4) * scale))
    for (rank, kind, lane, overlapped), spans in bars.items():
        y = (rank - 0.38, 0.56) if lane == "compute" else (rank + 0.22, 0.16)
        ax.broken_barh(spans, y, facecolors=KIND_COLORS.get(kind, "#333333"),
                       edgecolor="white" if lane == "compute" else "none",
                       linewidth=0.3, hatch="//" if overlapped else None,
                       alpha=1.0 if lane == "compute" else 0.7)
    px_per_s = width_in * dpi * 0.8 / (step * scale)
    for e in result.events:
        if e.lane != "compute" or e.microbatch is None:
            continue
        label = f"{e.stage}{e.kind}{e.microbatch}"
        if (e.end_s - e.start_s) * scale * px_per_s > 6.5 * len(label) + 2:
            ax.text((e.start_s + e.end_s) / 2 * scale, e.rank - 0.1, label, ha="center",
                    va="center", fontsize=7, color="white", clip_on=True)
    ax.set_ylim(a.pp - 0.5, -0.5)
    ax.set_yticks(range(a.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(a.pp)])
    ax.set_xlim(0, step * scale)
    ax.set_xlabel(f"time ({unit})")
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in result.events)]
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or (
        f"{a.name}: pp={a.pp}, {a.n_stages} stages, {a.n_microbatches} microbatches: "
        f"step {result.step_time_s * scale:.4g} {unit}, bubble {result.bubble_fraction:.1%}"
    ), fontsize=10)
    if memory:
        peak = max((r.peak_bytes for r in result.ranks), default=0)
        div, bunit = _byte_unit(peak)
        for timeline in result.memory:
            times = [t * scale for t in timeline.times_s] + [step * scale]
            totals = [b / div for b in timeline.total()]
            mem_ax.step(times, totals + totals[-1:], where="post",
                        label=f"rank {timeline.rank}", linewidth=1.2)
        mem_ax.set_ylabel(f"memory ({bunit})")
        mem_ax.set_xlabel(f"time ({unit})")
        mem_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                      frameon=False)
        mem_ax.grid(alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path
