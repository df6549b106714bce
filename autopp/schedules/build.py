"""Build a torch pipeline schedule for this rank's stages, from a name or a CSV file."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from autopp._compat import pipelining as _torch_compat
from autopp.schedules.checks import check_schedule_config
from autopp.schedules.registry import ScheduleInfo

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def _stage_layout(stages: Sequence[PipelineStage]) -> tuple[int, int, int]:
    """(pp rank, pp size, n_stages) shared by all of this rank's stages."""
    if not stages:
        raise ValueError("build_schedule needs this rank's pipeline stages, got none")
    layouts = {(s.group_rank, s.group_size, s.num_stages) for s in stages}
    if len(layouts) != 1:
        raise ValueError(
            "this rank's stages disagree on (pp rank, pp size, n_stages): "
            f"{sorted(layouts)}; build them all with the same pp group and stage count"
        )
    return layouts.pop()


def build_schedule(
    schedule: str | os.PathLike | ScheduleInfo,
    stages: Sequence[PipelineStage],
    *,
    n_microbatches: int,
    loss_fn: Callable[..., Any] | None,
    scale_grads: bool,
    runtime: bool = False,
    **schedule_kwargs: Any,
) -> Any:
    """The torch schedule that runs ``stages`` (this rank's stages) with ``schedule``.

    Args:
        schedule: a name from ``SCHEDULE_NAMES`` (any case), a compute-only CSV path, or a
            ``ScheduleInfo``.
        stages: this rank's ``PipelineStage`` objects, as ``stage_ids_for_rank`` places them.
        n_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target)`` on the last stage; None for forward only.
        scale_grads: passed to torch; autopp passes False and normalises the loss itself.
        runtime: always return torch's action-list runtime, which graph stages need; GPipe and
            1F1B then run as their action lists (:func:`single_stage_order`).
        **schedule_kwargs: passed on to the torch class.

    Checks the configuration and that the stages are the ones the schedule places here, so
    mistakes surface as ValueErrors naming numbers. Returns the torch schedule; call ``step``."""
    rank, pp, n_stages = _stage_layout(stages)
    info = check_schedule_config(schedule, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
    expected = info.stage_ids_for_rank(rank, pp, n_stages)
    given = sorted(s.stage_index for s in stages)
    if given != expected:
        raise ValueError(
            f"{info.name} places stages {expected} on pp rank {rank} of pp={pp} "
            f"({info.style} placement of {n_stages} stages), but this rank was given stages "
            f"{given}; build this rank's stages from "
            f"schedule_info(...).stage_ids_for_rank({rank}, {pp}, {n_stages})"
        )
    ordered = sorted(stages, key=lambda s: s.stage_index)
    common = dict(n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if info.csv is not None:
        return _torch_compat.new_csv_runtime(
            ordered, info.csv.path, **common, **schedule_kwargs
        )
    if info.multi_stage:
        return info.torch_class(ordered, **common, **schedule_kwargs)
    if runtime:
        order = single_stage_order(info.torch_class.__name__, pp, n_microbatches)
        return _torch_compat.runtime_from_order(ordered, order, **common, **schedule_kwargs)
    return info.torch_class(ordered[0], **common, **schedule_kwargs)


def single_stage_order(torch_class_name: str, pp: int, n_microbatches: int
                       ) -> dict[int, list[str]]:
    """The compute actions of torch's single-stage schedules, rank by rank (stage = rank).

    GPipe: every forward, then every backward. 1F1B: rank r runs ``min(M, pp - 1 - r)``
    warm-up forwards, then alternates one forward and one backward, then the remaining
    backwards. (torch 2.13's own ``Schedule1F1B.pipeline_order`` is only a picture: on the
    last rank it starts at microbatch 1, so it cannot be run as an action list.)
    """
    M = n_microbatches
    order: dict[int, list[str]] = {}
    for r in range(pp):
        fs = [f"{r}F{i}" for i in range(M)]
        bs = [f"{r}B{i}" for i in range(M)]
        if torch_class_name == "ScheduleGPipe":
            order[r] = fs + bs
            continue
        if torch_class_name != "Schedule1F1B":
            raise ValueError(f"{torch_class_name} is not a single-stage schedule")
        warm = min(M, pp - 1 - r)
        row = fs[:warm]
        for i in range(M - warm):
            row += [fs[warm + i], bs[i]]
        row += bs[M - warm:]
        order[r] = row
    return order
