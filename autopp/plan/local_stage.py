"""One stage planned on its sub-mesh, read from the on-disk plan cache when it is there
(under its request's key, :meth:`~autopp.sharding.request.StageRequest.key`). The one way
the pipeline's planning (:mod:`autopp.plan.make`), the dry run's reference layout and the
layout search's unit costs (:mod:`autopp.layout_search.unit_costs`) plan a stage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from autopp.plan.cache import cached_plan
from autopp.sharding import StagePlan, StageRequest, plan_stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageTiming:
    """Wall seconds spent planning a stage, and how many plans were solved, read from the
    cache or reused from an alike stage (:mod:`autopp.plan.stage_classes`); they add up over
    a stage's plans."""

    seconds: float = 0.0
    solved: int = 0
    cached: int = 0
    reused: int = 0

    def __add__(self, other: StageTiming) -> StageTiming:
        return StageTiming(self.seconds + other.seconds, self.solved + other.solved,
                           self.cached + other.cached, self.reused + other.reused)


def plan_local_stage(request: StageRequest, *, stage_index: int = 0
                     ) -> tuple[StagePlan, StageTiming]:
    """``request``'s plan (its ``cache_entry`` set to its key), from the on-disk cache when
    possible, and the time it took; ``stage_index`` names the stage in the log."""
    key = request.key()
    t0 = time.perf_counter()
    plan, hit = cached_plan(key, lambda: plan_stage(request))
    plan = dataclasses.replace(plan, cache_entry=key)
    dt = time.perf_counter() - t0
    logger.info("stage %d: plan %s (%s -> %s) in %.1f s (%s)", stage_index, key[:12],
                request.input_placements, request.output_placements, dt,
                "cached" if hit else "solved")
    return plan, StageTiming(dt, 0 if hit else 1, 1 if hit else 0)
