"""autopp's sharding planner: automatic DP×TP sharding of one pipeline stage on its sub-mesh.

Public API::

    plan = plan_stage(stage_on_meta, (x_meta,), sub_mesh, profile="H100",
                      memory_budget_bytes=..., time_limit_s=60)
    print(plan); plan.save("plan.json"); StagePlan.load("plan.json")
    ours, theirs = compare_with_torchtitan(stage_on_meta, (x_meta,), sub_mesh)  # same costs
    sharded = apply_plan(materialised_stage, plan, sub_mesh, (x_meta,))  # DTensor params
    y = sharded(x)  # x global (or a DTensor); y a DTensor in plan.output_placements

The planner's data path, one module per step, and its known limits are described in
docs/design.md (section "The sharding planner").
"""

from autopp.sharding.apply import apply_plan
from autopp.sharding.plan import StagePlan
from autopp.sharding.planner import plan_stage
from autopp.sharding.profiles import PROFILES, DeviceProfile, get_profile
from autopp.sharding.solver import InfeasiblePlanError
from autopp.sharding.torchtitan_ref import compare_with_torchtitan

__all__ = [
    "PROFILES",
    "apply_plan",
    "compare_with_torchtitan",
    "DeviceProfile",
    "InfeasiblePlanError",
    "StagePlan",
    "get_profile",
    "plan_stage",
]
