"""A planned stage's pieces priced by their exposed communication: overlap shortens F, I and
W, and the simulated step by exactly the hidden amount per microbatch."""

from __future__ import annotations

import pytest
import torch


def test_overlap_shortens_the_simulated_step_by_the_hidden_communication(make_mesh, stack_of):
    from autopp.estimate.pipeline import simulate_stages
    from autopp.estimate.stage_costs import param_dtypes, stage_cost, stage_facts, state_bytes
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request

    mesh = make_mesh(2, 2)
    stack = stack_of(2)
    x = torch.empty(8, 64, 256, device="meta")
    megatron = {"attention.qkv_linear.wqkv.weight": ("R", "S(0)"),
                "attention.wo.weight": ("R", "S(1)"), "feed_forward.w1.weight": ("R", "S(0)"),
                "feed_forward.w3.weight": ("R", "S(0)"), "feed_forward.w2.weight": ("R", "S(1)")}
    # tensor parallel with the sequence sharded between blocks: its gathers and
    # reductions sit in F and I (a budget-free plan is data parallel: all in REDUCE_GRAD)
    plan = plan_stage(stage_request(stack, (x,), mesh, microbatches_per_grad_reduce=4,
                                    param_placements={f"layers.{i}.{k}": v for i in range(2)
                                                      for k, v in megatron.items()},
                                    input_placements=("S(0)", "S(1)"),
                                    output_placements=("S(0)", "S(1)")))
    assert plan.comm_s > 0
    on = stage_facts(stack, plan, mesh, (x,), 4, overlap=True)
    off = stage_facts(stack, plan, mesh, (x,), 4, overlap=False)
    pieces = ("forward_s", "backward_input_s", "backward_weight_s")
    hidden = [getattr(off, p) - getattr(on, p) for p in pieces]
    assert all(h >= 0 for h in hidden) and sum(hidden) > 0, hidden
    assert sum(hidden) <= plan.comm_s  # only communication hides, never compute
    assert (on.unshard_s, on.reduce_grad_s) == (off.unshard_s, off.reduce_grad_s)
    state = state_bytes(plan, param_dtypes(stack))
    steps = [simulate_stages("1F1B", [stage_cost(f, state)], pp=1, n_microbatches=4,
                             stage_ranks=[0], profile=plan.profile, mesh_shape=(1, 2, 2)
                             ).step_time_s for f in (off, on)]
    assert steps[0] - steps[1] == pytest.approx(4 * sum(hidden), rel=1e-9)
