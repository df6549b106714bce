"""A model's stages for a schedule: the split (module FQNs per stage) checked against the
schedule's rules, and the pp rank each stage runs on (loop or V placement)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from autopp.stage_split.resolve import SplitSpec as Split
from autopp.stage_split.resolve import resolve_split

if TYPE_CHECKING:  # torch's pipelining costs ~1 s to import: the schedules load on first use
    from autopp.schedules import ScheduleInfo


def split_for_schedule(
    model: nn.Module, *, schedule: str, split: Split, pp: int, n_microbatches: int,
    local_batch_size: int | None, layers_attr: str | None = None,
) -> tuple[ScheduleInfo, list[list[str]]]:
    """The schedule's rules and the model's stages (module FQNs per stage), checked together.

    ``split=None`` gives as many uniform stages as the schedule places on ``pp`` ranks; an
    int gives that many uniform stages. Raises ValueError for a split, microbatch count or
    batch size the schedule cannot run.
    """
    from autopp.schedules import check_schedule_config, default_n_stages, schedule_info

    info = schedule_info(schedule)
    n_stages = default_n_stages(schedule, pp) if split is None else None
    if isinstance(split, int) and not isinstance(split, bool):
        n_stages = split
    fqns_per_stage = resolve_split(model, split, n_stages, layers_attr=layers_attr)
    check_schedule_config(
        schedule, pp=pp, n_stages=len(fqns_per_stage), n_microbatches=n_microbatches,
        local_batch_size=local_batch_size,
    )
    return info, fqns_per_stage


def stage_ranks_of(info: ScheduleInfo, pp: int, n_stages: int) -> tuple[int, ...]:
    """The pp rank holding each stage under the schedule's placement (loop or V)."""
    from autopp.schedules import stage_ids_for_rank

    return tuple(
        next(r for r in range(pp) if s in stage_ids_for_rank(r, pp, n_stages, info.style))
        for s in range(n_stages)
    )
