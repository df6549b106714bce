"""Work done once per job on rank 0 while the other ranks wait: the pipeline plan (rank 0
plans or reads the cache and broadcasts the plan's JSON), and any other value computed
there (:func:`broadcast_from_rank0`: the search, the startup estimates).

The waiting ranks wait on a CPU (gloo) group of their own with a long timeout
(``$AUTOPP_PLAN_TIMEOUT_S``, default 2 hours), never on the job's default group: under NCCL
the default group's watchdog (minutes) would kill the job before a large plan is made."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from autopp.plan.value import PipelinePlan

if TYPE_CHECKING:
    from autopp.plan.make import PipelineResult

T = TypeVar("T")
logger = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 7200.0
"""How long the other ranks wait for rank 0 by default (``$AUTOPP_PLAN_TIMEOUT_S``)."""


def wait_timeout_s() -> float:
    """Seconds the other ranks wait for rank 0 (``$AUTOPP_PLAN_TIMEOUT_S`` or 2 hours)."""
    return float(os.environ.get("AUTOPP_PLAN_TIMEOUT_S", WAIT_TIMEOUT_S))


def _alone() -> bool:
    """No peers: no process group, one rank, or the fake process group (where every
    process stands for its own rank)."""
    return not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake"


def broadcast_from_rank0(compute: Callable[[], T], *, what: str) -> T:
    """``compute()`` run on rank 0 of the world, its (picklable) value returned on every
    rank; an exception on rank 0 is raised on every rank, with a note naming ``what`` rank
    0 was doing. Collective. The others wait on a gloo group made for the wait, with
    :func:`wait_timeout_s` as its timeout (module doc). Without peers: ``compute()``."""
    if _alone():
        return compute()
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=wait_timeout_s()))
    t0 = time.perf_counter()
    try:
        if dist.get_rank() == 0:
            try:
                box: list[Any] = [("value", compute())]
            except Exception as e:
                try:
                    pickle.dumps(e)
                    sent: Any = ("error", e)
                except Exception:
                    sent = ("error", RuntimeError(f"{type(e).__name__}: {e}"))
                dist.broadcast_object_list([sent], src=0, group=group)
                raise
            dist.broadcast_object_list(box, src=0, group=group)
            return box[0][1]
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
        logger.info("%s on rank 0: %.1f s", what, time.perf_counter() - t0)
    kind, value = box[0]
    if kind == "error":  # rank 0's exception, raised here too
        value.add_note(f"(raised on rank 0 while {what}; this rank waited)")
        raise value
    return value


# ---- making one ------------------------------------------------------------------------
def plan_on_rank0(solve: Callable[[], PipelineResult]) -> tuple[PipelinePlan, str]:
    """``solve()``'s plan on every rank: rank 0 of the world solves (or reads the cache) and
    broadcasts the plan's JSON (:func:`broadcast_from_rank0`); the other ranks do not plan.
    An error on rank 0 is raised on every rank. Returns ``(plan, source)``: "planned",
    "cached" or "from rank 0". Without peers this process solves itself."""
    def local() -> tuple[PipelinePlan, str]:
        result = solve()
        return result.plan, "cached" if result.cached else "planned"

    if _alone():
        return local()
    mine: list[tuple[PipelinePlan, str]] = []

    def on_rank0() -> str:
        mine.append(local())
        return mine[0][0].to_json()

    text = broadcast_from_rank0(on_rank0, what="planning the pipeline")
    return mine[0] if mine else (PipelinePlan.from_json(text), "from rank 0")
