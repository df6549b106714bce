"""Plans made once per job: rank 0 of the world plans (or reads the cache) and broadcasts the
plan's JSON; the other ranks receive it."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from autopp.plan.value import PipelinePlan


# ---- making one ------------------------------------------------------------------------
def plan_on_rank0(solve: Callable[[], tuple[PipelinePlan, bool]]) -> tuple[PipelinePlan, str]:
    """``solve()``'s plan on every rank: rank 0 of the world solves (or reads the cache) and
    broadcasts the plan's JSON; the other ranks do not plan. An error on rank 0 is raised
    on every rank. Returns ``(plan, source)``: "planned", "cached" or "from rank 0".

    Without peers (no process group, one rank, or the fake process group, where every
    process stands for its own rank) this process solves itself."""
    def local() -> tuple[PipelinePlan, str]:
        plan, hit = solve()
        return plan, "cached" if hit else "planned"

    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return local()
    if dist.get_rank() == 0:
        try:
            plan, source = local()
        except Exception as e:
            try:
                pickle.dumps(e)
                sent: Any = ("error", e)
            except Exception:
                sent = ("error", RuntimeError(f"{type(e).__name__}: {e}"))
            dist.broadcast_object_list([sent], src=0)
            raise
        dist.broadcast_object_list([("plan", plan.to_json())], src=0)
        return plan, source
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":  # rank 0's exception, raised here too
        value.add_note("(raised on rank 0 while planning the pipeline; this rank did not plan)")
        raise value
    return PipelinePlan.from_json(value), "from rank 0"
