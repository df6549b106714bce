"""Checks of a pipeline configuration, run before torch sees it.

Each failure is a ValueError that names the numbers and says what to change, e.g.
"batch size 6 is not divisible by n_microbatches=4: ...". torch would otherwise fail later,
with less to go on (an AssertionError deep in its schedule validator, or a shape error).
"""

from __future__ import annotations

import os

from autopp.schedules.placement import check_stage_count
from autopp.schedules.registry import ScheduleInfo, schedule_info


def microbatches_ok(
    schedule: str | os.PathLike | ScheduleInfo, *, pp: int, n_stages: int, n_microbatches: int
) -> bool:
    """True if ``schedule`` can run ``n_microbatches`` microbatches per step (torch 2.13 rules).

    Assumes pp and n_stages themselves are valid for the schedule (see check_schedule_config).
    """
    info = schedule_info(schedule)
    if n_microbatches < 1:
        return False
    rule = info.microbatch_rule
    if rule == "any":
        return True
    if rule == "at_least_n_stages":
        return n_microbatches >= n_stages
    if rule == "whole_rounds":
        return n_microbatches % max(1, n_microbatches // pp) == 0
    if rule == "fixed":
        return info.csv is not None and n_microbatches == info.csv.n_microbatches
    raise AssertionError(f"unknown microbatch rule {rule!r}")


def _nearest_ok(info: ScheduleInfo, *, pp: int, n_stages: int, n_microbatches: int) -> str:
    """Valid counts just below and above ``n_microbatches`` under the whole-rounds rule."""
    def ok(n: int) -> bool:
        return microbatches_ok(info, pp=pp, n_stages=n_stages, n_microbatches=n)

    below = next((n for n in range(n_microbatches - 1, 0, -1) if ok(n)), None)
    # a multiple of pp is always valid, so the search ends within pp steps
    above = next((n for n in range(n_microbatches + 1, n_microbatches + 2 * pp + 1) if ok(n)), None)
    found = [str(n) for n in (below, above) if n is not None]
    return " or ".join(found)


def _check_stages(info: ScheduleInfo, *, pp: int, n_stages: int) -> None:
    lo, hi = info.min_stages_per_rank, info.max_stages_per_rank
    if info.csv is not None and (pp, n_stages) != (info.csv.pp, info.csv.n_stages):
        raise ValueError(
            f"schedule CSV {info.name!r} is written for pp={info.csv.pp} and "
            f"n_stages={info.csv.n_stages}, got pp={pp} and n_stages={n_stages}; use those "
            "sizes or write a CSV for yours"
        )
    if lo == hi and pp >= 1 and n_stages != lo * pp:
        per = "stage" if lo == 1 else "stages"
        raise ValueError(
            f"{info.name} needs exactly {lo} {per} per rank, got {n_stages} stages over "
            f"pp={pp}; use n_stages={lo * pp}"
        )
    check_stage_count(n_stages, pp)
    per_rank = n_stages // pp
    if per_rank < lo or (hi is not None and per_rank > hi):
        allowed = f"at least {lo}" if hi is None else f"{lo} to {hi}"
        raise ValueError(
            f"{info.name} needs {allowed} stages per rank, got {n_stages} stages over pp={pp}"
        )


def _check_microbatches(
    info: ScheduleInfo, *, pp: int, n_stages: int, n_microbatches: int
) -> None:
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches}: a step needs at least one microbatch")
    if microbatches_ok(info, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches):
        return
    rule = info.microbatch_rule
    if rule == "fixed":
        assert info.csv is not None
        raise ValueError(
            f"schedule CSV {info.name!r} is written for n_microbatches={info.csv.n_microbatches}, "
            f"got n_microbatches={n_microbatches}; use {info.csv.n_microbatches} or write a CSV "
            "for yours"
        )
    if rule == "at_least_n_stages":
        raise ValueError(
            f"{info.name} needs n_microbatches >= n_stages={n_stages} (one microbatch in flight "
            f"per stage), got n_microbatches={n_microbatches}; "
            f"use n_microbatches={n_stages} or more"
        )
    if rule == "whole_rounds":
        rounds = max(1, n_microbatches // pp)
        fix = _nearest_ok(info, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
        raise ValueError(
            f"{info.name} splits n_microbatches={n_microbatches} into n_microbatches // pp = "
            f"{rounds} rounds, and {n_microbatches} is not a multiple of {rounds}; use "
            f"n_microbatches={fix} (any value below 2 * pp = {2 * pp}, or a multiple of pp, works)"
        )
    raise AssertionError(f"no message for microbatch rule {rule!r}")


def check_batch_size(local_batch_size: int, n_microbatches: int, *,
                     schedule: ScheduleInfo | None = None, pp: int | None = None,
                     n_stages: int | None = None) -> None:
    """Raise ValueError unless the batch splits into ``n_microbatches`` equal microbatches.

    With ``schedule``, ``pp`` and ``n_stages``, the counts the message suggests instead are
    only those the schedule accepts at that size (a suggestion passes the same checks), and
    when none does, the message says what would."""
    if local_batch_size < 1:
        raise ValueError(f"batch size {local_batch_size}: a step needs at least one sample")
    if local_batch_size % n_microbatches == 0:
        return
    divisors = [d for d in range(1, local_batch_size + 1) if local_batch_size % d == 0]
    head = (f"batch size {local_batch_size} is not divisible by n_microbatches={n_microbatches}: "
            f"every microbatch must hold the same number of samples; use a batch size that is "
            f"a multiple of {n_microbatches}")
    if schedule is None or pp is None or n_stages is None:
        raise ValueError(f"{head}, or n_microbatches in {divisors}")
    fits = [d for d in divisors
            if microbatches_ok(schedule, pp=pp, n_stages=n_stages, n_microbatches=d)]
    if fits:
        raise ValueError(f"{head}, or n_microbatches in {fits}")
    from autopp.schedules.registry import SCHEDULE_NAMES

    # schedules that take any microbatch count (their runs need nothing else of it)
    others = [name for name in SCHEDULE_NAMES if name != schedule.name
              and schedule_info(name).microbatch_rule == "any"
              and _stages_ok(schedule_info(name), pp=pp, n_stages=n_stages)]
    raise ValueError(
        f"{head}; no count dividing {local_batch_size} suits {schedule.name} with {n_stages} "
        f"stages over pp={pp}"
        + (f", but {', '.join(others)} run{'s' if len(others) == 1 else ''} it with "
           f"n_microbatches in {divisors}" if others else ""))


def _stages_ok(info: ScheduleInfo, *, pp: int, n_stages: int) -> bool:
    try:
        _check_stages(info, pp=pp, n_stages=n_stages)
    except ValueError:
        return False
    return True


def check_schedule_config(
    schedule: str | os.PathLike | ScheduleInfo,
    *,
    pp: int,
    n_stages: int,
    n_microbatches: int,
    local_batch_size: int | None = None,
) -> ScheduleInfo:
    """Check that ``schedule`` can run with these sizes; returns the schedule's ScheduleInfo.

    Args:
        schedule: a schedule name (see ``SCHEDULE_NAMES``), a CSV file path, or a ScheduleInfo.
        pp: number of pipeline ranks.
        n_stages: number of pipeline stages in total (``default_n_stages`` gives the usual one).
        n_microbatches: microbatches per step.
        local_batch_size: the batch size one pipeline replica (one data-parallel rank) steps
            with, if known; it must split evenly into microbatches.

    Raises ValueError, in this order, for: stages per rank the schedule does not allow,
    n_stages not a multiple of pp, too few or a badly rounded n_microbatches, and a batch size
    not divisible by n_microbatches. Each message names the numbers and a fix.
    """
    info = schedule_info(schedule)
    _check_stages(info, pp=pp, n_stages=n_stages)
    _check_microbatches(info, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches)
    if local_batch_size is not None:
        check_batch_size(local_batch_size, n_microbatches, schedule=info, pp=pp,
                         n_stages=n_stages)
    return info
