import torch

from autopp.sharding import StagePlan, plan_stage
from tests.harness.stage_request import stage_request


def test_plan_json_round_trip_and_report(mlp_meta, make_mesh, tmp_path):
    x = torch.empty(8, 1024, 512, device="meta")
    plan = plan_stage(stage_request(mlp_meta, (x,), make_mesh(2, 2), memory_budget_bytes=3e6))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert StagePlan.load(path) == plan
    text = str(plan)
    for needle in ("up.weight", "down.weight", "estimated step time", "Collectives",
                   "parameter memory per device", "Fallbacks", "none"):
        assert needle in text
    # every plan field is a plain value (hashable, immutable)
    hash(plan.params)


def test_gradient_reductions_amortised_over_microbatches(make_mesh, stack_of):
    """Planned stages reduce gradients once per step: with M microbatches a gradient's
    reduction costs 1/M per microbatch, so FSDP-style plans get cheaper."""
    import torch

    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request

    mesh = make_mesh(2, 2)
    stack = stack_of(1)
    x = torch.empty(4, 16, 256, device="meta")
    budget = sum(p.numel() * p.element_size() for p in stack.parameters()) / 4
    once = plan_stage(stage_request(stack, (x,), mesh, memory_budget_bytes=budget))
    per_step = plan_stage(stage_request(stack, (x,), mesh, memory_budget_bytes=budget,
                                        microbatches_per_grad_reduce=8))
    assert per_step.comm_s < once.comm_s
    assert per_step.step_time_s < once.step_time_s
