"""Pipeline schedules written as CSV files, and dumps of built schedules to CSV.

The format is torch's compute-only CSV: one row per pp rank, one cell per time step, each cell
an action string ``{stage}{type}{microbatch}`` such as "0F0" (forward of microbatch 0 on
stage 0), "1B0" (full backward), "0I0" / "0W0" (backward for inputs / for weights), an
overlapped pair "(0F3;3B1)OVERLAP_F_B", or empty for an idle step. Communication is not
written: torch's runtime adds the sends and receives when it loads the file.

A CSV fixes the pipeline size (its number of rows), the stages each rank holds and the
number of microbatches; :func:`read_schedule_csv` reads all three back from the file.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopp._compat import pipelining as _torch_compat
from autopp.schedules.placement import infer_placement

#: A schedule's order: for each pp rank, its steps as action strings (None = idle step).
ScheduleOrder = dict[int, list[str | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class CsvSchedule:
    """What a compute-only schedule CSV file says, checked by torch's schedule validator."""

    path: str
    """The file it was read from."""
    pp: int
    """Number of pipeline ranks (rows of the file)."""
    n_stages: int
    """Number of pipeline stages (largest stage index + 1)."""
    n_microbatches: int
    """Number of microbatches each step runs; a CSV schedule only runs with this count."""
    stage_ids: tuple[tuple[int, ...], ...]
    """``stage_ids[r]``: the stages rank r holds, increasing."""
    style: str
    """Placement of the stages: "loop", "v", or "custom" (see ``autopp.schedules.placement``)."""
    splits_backward: bool
    """True if the backward is split into input-grad (I) and weight-grad (W) steps."""
    order: tuple[tuple[str | None, ...], ...]
    """``order[r]``: rank r's steps as written in the file (None = idle step)."""

    @property
    def stages_per_rank(self) -> int:
        """Number of stages each rank holds."""
        return self.n_stages // self.pp


def is_csv_schedule(schedule: str | os.PathLike) -> bool:
    """True if ``schedule`` names a CSV file (a path ending in .csv) rather than a schedule."""
    return isinstance(schedule, os.PathLike) or str(schedule).lower().endswith(".csv")


def read_order_csv(path: str | os.PathLike) -> ScheduleOrder:
    """Read a schedule CSV file as written, rank by rank, without checking it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"schedule CSV file {str(path)!r} does not exist")
    with path.open(newline="") as f:
        rows = [row for row in csv.reader(f)]
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # trailing blank lines
    return {rank: [cell.strip() or None for cell in row] for rank, row in enumerate(rows)}


def write_order_csv(order: ScheduleOrder, path: str | os.PathLike) -> None:
    """Write a schedule order as a compute-only CSV file (one row per rank, in rank order)."""
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(order):
            writer.writerow(["" if a is None else a for a in order[rank]])


def read_schedule_csv(path: str | os.PathLike) -> CsvSchedule:
    """Read and check a compute-only schedule CSV file.

    Infers pp (rows), the stages each rank holds, their placement style, n_stages and
    n_microbatches, then runs torch's schedule validator on it. Raises ValueError naming the
    file for a missing file, a malformed or non-compute action, stages spread unevenly over
    the ranks, or an order torch rejects (e.g. a backward before its forward).
    """
    where = str(path)
    order = read_order_csv(path)
    if not order:
        raise ValueError(f"schedule CSV {where!r} is empty: expected one row per pp rank")
    per_rank: list[set[int]] = []
    forwards: dict[int, set[int | None]] = {}
    splits = False
    for rank, row in order.items():
        held: set[int] = set()
        for step, cell in enumerate(row):
            try:
                parts = _torch_compat.compute_parts(cell) if cell else None
            except ValueError as exc:
                where_step = f"schedule CSV {where!r}, rank {rank}, step {step}"
                raise ValueError(f"{where_step}: {exc}") from exc
            for stage, kind, mb in parts or ():
                held.add(stage)
                splits |= kind in ("I", "W")
                if kind == "F":
                    forwards.setdefault(stage, set()).add(mb)
        if not held:
            raise ValueError(f"schedule CSV {where!r}: rank {rank} runs no stage")
        per_rank.append(held)
    pp = len(per_rank)
    n_stages = max(max(held) for held in per_rank) + 1
    counts = sorted({len(held) for held in per_rank})
    if len(counts) > 1:
        raise ValueError(
            f"schedule CSV {where!r}: ranks hold different numbers of stages "
            f"({[sorted(h) for h in per_rank]}); autopp needs the same number on every rank"
        )
    n_microbatches = len(forwards.get(0, ()))
    try:
        _torch_compat.validate_compute_order(
            order, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches
        )
    except ValueError as exc:
        raise ValueError(f"schedule CSV {where!r} is not a valid schedule: {exc}") from exc
    stage_ids = tuple(tuple(sorted(held)) for held in per_rank)
    return CsvSchedule(
        path=where,
        pp=pp,
        n_stages=n_stages,
        n_microbatches=n_microbatches,
        stage_ids=stage_ids,
        style=infer_placement([list(ids) for ids in stage_ids]),
        splits_backward=splits,
        order=tuple(tuple(order[r]) for r in range(pp)),
    )


def schedule_order(schedule_obj: Any) -> ScheduleOrder:
    """A built schedule's compute-only order: for each pp rank, its steps as action strings.

    ``schedule_obj`` is what :func:`autopp.schedules.build_schedule` returns (any torch
    pipeline schedule built with a loss function). Idle steps are ``None``.
    """
    return _torch_compat.compute_only_order(schedule_obj)


def dump_schedule_csv(schedule_obj: Any, path: str | os.PathLike) -> None:
    """Write a built schedule's compute-only order to a CSV file that ``build_schedule`` loads.

    Works for multi-stage and single-stage schedules; grad-reduction and communication steps
    are left out (torch's runtime adds them back when it loads the file). Loading the file
    gives the same order, so a dumped schedule can be edited by hand and run.
    """
    write_order_csv(schedule_order(schedule_obj), path)
