"""Mixed precision in plans: bf16 compute, parameters gathered in bf16, gradient
reductions after the cast back to fp32 (fake process group, no devices)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopp.sharding import plan_stage
from tests.harness.stage_request import stage_request
from autopp.tracing.units import stage_units
from autopp.lower.local_graphs import lower_joint
from autopp.tracing.precision import check_policy, maybe_cast
from autopp.tracing.joint import trace_joint
from tests.lower._apply_worker import build

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
_PASS = ("wait_tensor", "view", "reshape", "_to_copy", "reduce_scatter", "all_reduce", "clone",
         "aten.t.", "split", "getitem")


def _grad_chain(node):
    """The data-movement chain (casts, views, collectives) ending at a gradient output."""
    chain = []
    while node is not None and node.op == "call_function" and any(
        k in str(node.target) for k in _PASS
    ):
        chain.append(node)
        node = node.all_input_nodes[0] if node.all_input_nodes else None
    return chain[::-1]


def test_bf16_plan_gathers_bf16_and_reduces_fp32(make_mesh):
    mesh = make_mesh(2, 2)
    stack = build("meta", "stack")
    x = torch.empty(4, 16, 256, dtype=torch.bfloat16, device="meta")
    budget = sum(p.numel() * 4 for p in stack.parameters()) / 4  # forces FSDP-like sharding
    plan = plan_stage(stage_request(stack, (x,), mesh, memory_budget_bytes=budget,
                                    output_placements=None, mixed_precision=BF16))
    assert plan.param_dtype == "bfloat16" and "mixed precision" in str(plan)
    unit = stage_units(stack)[0]
    joint = trace_joint(maybe_cast(unit.module, "bfloat16"), (x,))
    local = lower_joint(joint, plan.blocks[0], mesh)
    nodes = list(local.gm.graph.nodes)
    params = [n for n in nodes if n.op == "placeholder"][: local.signature.num_params]
    assert all(p.meta["val"].dtype == torch.float32 for p in params)  # fp32 masters
    # parameters are all-gathered after their cast to bf16 (half the bytes)
    gathers = [n for n in nodes if "all_gather" in str(n.target)]
    param_gathers = [g for g in gathers if _source(g.args[0]) in params]
    assert param_gathers and all(
        g.args[0].meta["val"].dtype == torch.bfloat16 for g in param_gathers
    ), [(str(_source(g.args[0])), g.args[0].meta["val"].dtype) for g in param_gathers]
    # every reduction on a gradient's way out runs after its cast back to fp32
    outs = local.gm.graph.output_node().args[0]
    sig = local.signature
    reductions = 0
    for out in outs[sig.num_outputs : sig.num_outputs + sig.num_param_grads]:
        chain = _grad_chain(out)
        assert out.meta["val"].dtype == torch.float32
        for n in chain:
            if "reduce_scatter" in str(n.target) or "all_reduce" in str(n.target):
                assert n.args[0].meta["val"].dtype == torch.float32, [str(c.target) for c in chain]
                reductions += 1
    assert reductions > 0


def _source(node):
    """Walk up single-input data movement (casts, views, waits, collectives) to its source."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and any(
        k in str(node.target) for k in _PASS + ("all_gather",)
    ):
        node = node.all_input_nodes[0]
    return node


def test_check_policy():
    stack = build("meta", "stack")
    assert check_policy(None, stack) is None
    assert check_policy(BF16, stack) == "bfloat16"
    with pytest.raises(ValueError, match="reduce_dtype=torch.bfloat16 must equal"):
        check_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.bfloat16), stack)
    with pytest.raises(ValueError, match="output_dtype"):
        check_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          output_dtype=torch.float32), stack)
