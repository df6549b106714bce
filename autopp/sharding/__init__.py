"""autopp's sharding planner: automatic DP×TP sharding of one pipeline stage on its sub-mesh.

Public API::

    plan = plan_stage(stage_on_meta, (x_meta,), sub_mesh, profile="H100",
                      memory_budget_bytes=..., time_limit_s=60)
    print(plan); plan.save("plan.json"); StagePlan.load("plan.json")

Planning only: running a plan is :mod:`autopp.lower` (``autopp.lower.apply.apply_plan``),
device profiles are :mod:`autopp.profiles`, ops with rules of their own are :mod:`autopp.ops`,
torchtitan's hand-written plan priced under the same costs (``compare_with_torchtitan``) is
model knowledge and lives with the adapters (:mod:`autopp.adapters.torchtitan_reference`).

The planner's data path, one module per step, and its known limits are described in
docs/design.md (section "The sharding planner").
"""

from autopp.sharding.plan import StagePlan
from autopp.sharding.planner import plan_stage
from autopp.sharding.solution import InfeasiblePlanError

__all__ = [
    "InfeasiblePlanError",
    "StagePlan",
    "plan_stage",
]
