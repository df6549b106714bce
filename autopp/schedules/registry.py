"""Schedule names and what each schedule needs: one table, :data:`_TABLE`.

torch's own constraints, read from its ``schedules.py`` and checked by constructing every
schedule for small sizes (tests/schedules/test_schedules.py):

    schedule               class   place  stages/rank  n_microbatches
    GPipe                  single  loop   1            any
    1F1B                   single  loop   1            >= n_stages (= pp)
    Interleaved1F1B        multi   loop   >= 1         multiple of max(1, n_mb // pp)
    LoopedBFS              multi   loop   >= 1         any
    InterleavedZeroBubble  multi   loop   >= 1         multiple of max(1, n_mb // pp)
    ZBVZeroBubble          multi   v      2            any
    DualPipeV              multi   v      2            >= n_stages (= 2 pp)

A compute-only CSV file is a schedule too; its layout and microbatches come from the file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from torch.distributed import pipelining as _pp  # public schedule classes only

from autopp._compat import pipelining as _torch_compat
from autopp.schedules.csv_schedules import CsvSchedule, is_csv_schedule, read_schedule_csv
from autopp.schedules.placement import Placement, stage_ids_for_rank

MicrobatchRule = Literal["any", "at_least_n_stages", "whole_rounds", "fixed"]
"""How a schedule limits n_microbatches: no limit; at least one per stage; a multiple of the
number of rounds ``max(1, n_microbatches // pp)``; exactly the count a CSV file was written for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleInfo:
    """What autopp needs to know about one pipeline schedule."""

    name: str
    """Canonical name (e.g. "Interleaved1F1B"), or the CSV file's path."""
    torch_class: type
    """The torch.distributed.pipelining class that runs it."""
    multi_stage: bool
    """False: the class takes a single stage per rank; True: it takes the rank's list of stages."""
    style: Placement | Literal["custom"]
    """How stages sit on ranks: "loop", "v", or "custom" (only a CSV file's own layout)."""
    min_stages_per_rank: int
    """Fewest stages one rank may hold."""
    max_stages_per_rank: int | None
    """Most stages one rank may hold; None for no limit."""
    default_stages_per_rank: int
    """Stages per rank autopp uses when the user does not say: 1 for single-stage, else 2."""
    splits_backward: bool
    """True if the backward runs as two steps, input grads (I) then weight grads (W)."""
    microbatch_rule: MicrobatchRule
    """Limit on n_microbatches; see :data:`MicrobatchRule`."""
    csv: CsvSchedule | None = None
    """For a CSV-defined schedule, what the file says; None for a named schedule."""

    def stage_ids_for_rank(self, pp_rank: int, pp_size: int, n_stages: int) -> list[int]:
        """The stage indices rank ``pp_rank`` holds under this schedule's placement."""
        if self.csv is not None:
            if (pp_size, n_stages) != (self.csv.pp, self.csv.n_stages):
                raise ValueError(
                    f"schedule CSV {self.name!r} is for pp={self.csv.pp} and "
                    f"n_stages={self.csv.n_stages}, got pp={pp_size} and n_stages={n_stages}"
                )
            if not 0 <= pp_rank < pp_size:
                raise ValueError(
                    f"pp_rank={pp_rank} is outside the pipeline's ranks 0..{pp_size - 1}"
                )
            return list(self.csv.stage_ids[pp_rank])
        return stage_ids_for_rank(pp_rank, pp_size, n_stages, self.style)


def _named(
    name: str,
    cls: type,
    *,
    multi: bool,
    style: Placement,
    stages: tuple[int, int | None],
    splits: bool,
    microbatches: MicrobatchRule,
) -> ScheduleInfo:
    return ScheduleInfo(
        name=name,
        torch_class=cls,
        multi_stage=multi,
        style=style,
        min_stages_per_rank=stages[0],
        max_stages_per_rank=stages[1],
        default_stages_per_rank=2 if multi else 1,
        splits_backward=splits,
        microbatch_rule=microbatches,
    )


_TABLE: tuple[ScheduleInfo, ...] = (
    _named("GPipe", _pp.ScheduleGPipe, multi=False, style="loop", stages=(1, 1),
           splits=False, microbatches="any"),
    _named("1F1B", _pp.Schedule1F1B, multi=False, style="loop", stages=(1, 1),
           splits=False, microbatches="at_least_n_stages"),
    _named("Interleaved1F1B", _pp.ScheduleInterleaved1F1B, multi=True, style="loop",
           stages=(1, None), splits=False, microbatches="whole_rounds"),
    _named("LoopedBFS", _pp.ScheduleLoopedBFS, multi=True, style="loop", stages=(1, None),
           splits=False, microbatches="any"),
    _named("InterleavedZeroBubble", _pp.ScheduleInterleavedZeroBubble, multi=True,
           style="loop", stages=(1, None), splits=True, microbatches="whole_rounds"),
    _named("ZBVZeroBubble", _pp.ScheduleZBVZeroBubble, multi=True, style="v", stages=(2, 2),
           splits=True, microbatches="any"),
    _named("DualPipeV", _pp.ScheduleDualPipeV, multi=True, style="v", stages=(2, 2),
           splits=True, microbatches="at_least_n_stages"),
)  # fmt: skip

#: The schedule names autopp accepts (case-insensitive), besides paths of CSV files.
SCHEDULE_NAMES: tuple[str, ...] = tuple(info.name for info in _TABLE)
_BY_LOWER_NAME = {info.name.lower(): info for info in _TABLE}


def _csv_info(path: str | os.PathLike) -> ScheduleInfo:
    spec = read_schedule_csv(path)
    return ScheduleInfo(
        name=spec.path,
        torch_class=_torch_compat.RUNTIME_SCHEDULE_CLASS,
        multi_stage=True,
        style=spec.style,
        min_stages_per_rank=spec.stages_per_rank,
        max_stages_per_rank=spec.stages_per_rank,
        default_stages_per_rank=spec.stages_per_rank,
        splits_backward=spec.splits_backward,
        microbatch_rule="fixed",
        csv=spec,
    )


def schedule_info(schedule: str | os.PathLike | ScheduleInfo) -> ScheduleInfo:
    """Look up a schedule by name (case-insensitive) or read it from a CSV file path.

    Raises ValueError listing the valid names for an unknown name, or describing what is
    wrong with a CSV file. A ScheduleInfo passed in is returned as is.
    """
    if isinstance(schedule, ScheduleInfo):
        return schedule
    if is_csv_schedule(schedule):
        return _csv_info(schedule)
    info = _BY_LOWER_NAME.get(str(schedule).lower())
    if info is None:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; valid names are "
            f"{', '.join(SCHEDULE_NAMES)} (any case), or the path of a compute-only .csv file"
        )
    return info


def default_n_stages(schedule: str | os.PathLike | ScheduleInfo, pp: int) -> int:
    """Number of pipeline stages autopp makes for ``schedule`` on ``pp`` ranks by default.

    pp for single-stage schedules (GPipe, 1F1B), 2 * pp for the others; a CSV file's own count.
    """
    info = schedule_info(schedule)
    if info.csv is not None and info.csv.pp != pp:
        raise ValueError(
            f"schedule CSV {info.name!r} has {info.csv.pp} rows (pp ranks), got pp={pp}"
        )
    return pp * info.default_stages_per_rank
