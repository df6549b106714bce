"""Every rank's action list for a schedule, as torch's runtime would run it, without processes.

:func:`schedule_actions` gives a :class:`ScheduleActions` for a schedule name, a compute-only
CSV file, or a compute-only order written in Python (:func:`actions_from_order`). The compute
orders are torch's own: multi-stage classes constructed over stand-in stages as every
training rank constructs them; GPipe and 1F1B as autopp runs them
(:func:`~autopp.schedules.build.single_stage_order`, since torch's
``Schedule1F1B.pipeline_order`` is only a picture); CSV and Python orders as written. torch's
runtime passes then add UNSHARD / RESHARD, REDUCE_GRAD and the SEND / RECV pairs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from autopp._compat import pipelining as _torch_compat
from autopp.schedules.build import single_stage_order
from autopp.schedules.checks import check_schedule_config
from autopp.schedules.registry import ScheduleInfo, default_n_stages, schedule_info


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleActions:
    """A whole pipeline schedule as plain values: what each pp rank runs, in order."""

    name: str
    """The schedule's name ("1F1B", ...), a CSV file's path, or "custom"."""
    pp: int
    """Number of pipeline ranks."""
    n_stages: int
    """Number of pipeline stages (``n_stages // pp`` per rank)."""
    n_microbatches: int
    """Microbatches per training step."""
    stage_to_rank: tuple[int, ...]
    """``stage_to_rank[s]``: the pp rank that holds stage s."""
    compute: tuple[tuple[str | None, ...], ...]
    """``compute[r]``: rank r's compute steps as torch action strings ("0F1", "3I0", "0W0",
    "(0F3;3B1)OVERLAP_F_B"); None is an idle step of the schedule's picture."""
    lowered: tuple[tuple[str, ...], ...]
    """``lowered[r]``: what torch's runtime runs on rank r, in order: the compute steps plus
    "1UNSHARD", "1RESHARD", "1REDUCE_GRAD", "0SEND_F2", "1RECV_F2", "1SEND_B2", "0RECV_B2"."""

    def stage_ids(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, increasing."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def format(self) -> str:
        """The lowered lists, one line per rank (for printing)."""
        return "\n".join(f"rank {r}: {' '.join(row)}" for r, row in enumerate(self.lowered))


def _freeze(
    name: str,
    *,
    pp: int,
    n_stages: int,
    n_microbatches: int,
    compute: dict[int, list[str | None]],
    lowered: dict[int, list[str]],
    stage_to_rank: dict[int, int],
) -> ScheduleActions:
    return ScheduleActions(
        name=name,
        pp=pp,
        n_stages=n_stages,
        n_microbatches=n_microbatches,
        stage_to_rank=tuple(stage_to_rank[s] for s in range(n_stages)),
        compute=tuple(tuple(compute.get(r, ())) for r in range(pp)),
        lowered=tuple(tuple(lowered.get(r, ())) for r in range(pp)),
    )


@lru_cache(maxsize=1024)
def compute_order(schedule: str | os.PathLike, *, pp: int, n_microbatches: int, n_stages: int
                  ) -> tuple[tuple[tuple[str | None, ...], ...], tuple[int, ...]]:
    """A named schedule's compute steps per rank (torch's action strings, None idle) and the
    pp rank of each stage, without torch's lowering to comms (cheap where
    :func:`schedule_actions` takes seconds: pp=64 and more)."""
    info = schedule_info(schedule)
    if info.csv is not None:  # a file's order: as lowered
        acts = schedule_actions(info, pp=pp, n_microbatches=n_microbatches, n_stages=n_stages)
        return acts.compute, acts.stage_to_rank
    check_schedule_config(info, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
    if info.multi_stage:
        compute, stage_to_rank = _torch_compat.named_compute_order(
            info.torch_class, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches,
            style=str(info.style))
    else:
        compute = dict(single_stage_order(info.torch_class.__name__, pp, n_microbatches))
        stage_to_rank = {s: s for s in range(n_stages)}
    return (tuple(tuple(compute.get(r, ())) for r in range(pp)),
            tuple(stage_to_rank[s] for s in range(n_stages)))


@lru_cache(maxsize=256)
def _named_actions(name: str, pp: int, n_stages: int, n_microbatches: int) -> ScheduleActions:
    info = schedule_info(name)
    if info.multi_stage:
        compute, lowered, stage_to_rank = _torch_compat.lowered_named_schedule(
            info.torch_class, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches,
            style=str(info.style),
        )
    else:
        compute = dict(single_stage_order(info.torch_class.__name__, pp, n_microbatches))
        lowered, stage_to_rank = _torch_compat.lowered_compute_order(
            compute, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches
        )
    return _freeze(info.name, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches,
                   compute=compute, lowered=lowered, stage_to_rank=stage_to_rank)


def schedule_actions(
    schedule: str | os.PathLike | ScheduleInfo,
    *,
    pp: int | None = None,
    n_microbatches: int | None = None,
    n_stages: int | None = None,
) -> ScheduleActions:
    """Every rank's action list for ``schedule``, as torch's runtime would run it.

    Args:
        schedule: a name from ``SCHEDULE_NAMES`` (any case), a compute-only CSV path, or a
            ``ScheduleInfo``.
        pp: pipeline ranks; required for a name, the row count for a CSV file.
        n_microbatches: microbatches per step; required for a name, fixed by a CSV file.
        n_stages: stages in total; default ``default_n_stages(schedule, pp)``.

    Raises ValueError for an unknown schedule (listing the names), a missing pp or
    n_microbatches, or sizes the schedule cannot run, naming the numbers and a fix."""
    info = schedule_info(schedule)
    if info.csv is not None:
        spec = info.csv
        pp = spec.pp if pp is None else pp
        n_microbatches = spec.n_microbatches if n_microbatches is None else n_microbatches
        n_stages = spec.n_stages if n_stages is None else n_stages
        check_schedule_config(info, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
        order = {r: list(row) for r, row in enumerate(spec.order)}
        return actions_from_order(order, n_microbatches=n_microbatches, name=spec.path)
    if pp is None or n_microbatches is None:
        raise ValueError(
            f"schedule {info.name!r} needs pp= (pipeline ranks) and n_microbatches= "
            f"(microbatches per step); got pp={pp}, n_microbatches={n_microbatches}"
        )
    if n_stages is None:
        n_stages = default_n_stages(info, pp)
    check_schedule_config(info, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
    return _named_actions(info.name, pp, n_stages, n_microbatches)


def actions_from_order(
    order: dict[int, list[str | None]],
    *,
    n_microbatches: int | None = None,
    name: str = "custom",
) -> ScheduleActions:
    """The action lists of a compute-only order written as values (e.g. read from a CSV).

    Args:
        order: for each pp rank 0..pp-1, its compute steps as torch action strings ("0F0",
            "1B0", "0I0", "0W0", "(0F3;3B1)OVERLAP_F_B"); None or "" for an idle step.
        n_microbatches: microbatches per step; default: the number of forwards of stage 0.
        name: what to call the schedule in results and pictures.

    torch's validator checks the order (ValueError naming what is wrong, e.g. a backward
    before its forward) and infers the stage placement from it.
    """
    if not order or sorted(order) != list(range(len(order))):
        raise ValueError(
            f"order must have one row per pp rank 0..pp-1, got rows for ranks {sorted(order)}"
        )
    clean = {r: [cell or None for cell in row] for r, row in order.items()}
    stages: set[int] = set()
    forwards_0: set[int | None] = set()
    for row in clean.values():
        for cell in row:
            for stage, kind, mb in _torch_compat.compute_parts(cell) if cell else ():
                stages.add(stage)
                if stage == 0 and kind == "F":
                    forwards_0.add(mb)
    if not stages:
        raise ValueError("order holds no compute step; write at least one forward per stage")
    n_stages = max(stages) + 1
    if n_microbatches is None:
        n_microbatches = len(forwards_0)
    pp = len(clean)
    try:
        lowered, stage_to_rank = _torch_compat.lowered_compute_order(
            clean, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches
        )
    except ValueError as exc:
        raise ValueError(f"order {name!r} is not a valid schedule: {exc}") from exc
    return _freeze(name, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches,
                   compute=clean, lowered=lowered, stage_to_rank=stage_to_rank)
