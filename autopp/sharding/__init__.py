"""autopp's sharding planner: automatic DP×TP sharding of one pipeline stage on its sub-mesh.

Public API::

    plan = plan_stage(StageRequest(module=stage_on_meta, example_inputs=(x_meta,),
                                   mesh=sub_mesh, profile="H100",
                                   memory=StageMemory(budget_bytes=...)))
    print(plan); plan.save("plan.json"); StagePlan.load("plan.json")

Planning only: running a plan is :mod:`autopp.lower`, device profiles :mod:`autopp.profiles`,
ops with rules of their own :mod:`autopp.ops`, torchtitan's hand-written plan priced for
comparison :mod:`autopp.adapters.torchtitan_reference`. The planner's steps and known limits:
docs/design.md, "the sharding planner"."""

from autopp.sharding.plan import StagePlan
from autopp.sharding.planner import plan_stage
from autopp.sharding.request import StageMemory, StageRequest
from autopp.sharding.ilp.solution import InfeasiblePlanError

__all__ = [
    "InfeasiblePlanError",
    "StageMemory",
    "StagePlan",
    "StageRequest",
    "plan_stage",
]
