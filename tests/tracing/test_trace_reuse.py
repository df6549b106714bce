"""A stage costed after it was planned in the same process reuses the planner's traces
(autopp.sharding.chain.blocks.trace_unit and autopp.estimate.stage_costs.stage_facts both go
through autopp.tracing.cache), the stage cut's hooked end blocks included."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopp.estimate.stage_costs import stage_facts
from autopp.sharding import plan_stage
from autopp.tracing import cache as trace_cache
from tests.harness.stage_request import stage_request
from autopp.tracing.cache import plainest, trace_stats
from autopp.stage_split import build_stage_module

X = torch.empty(8, 64, 256, device="meta")


def test_costing_a_planned_middle_stage_traces_nothing_again(llama_debug, make_mesh):
    stage = build_stage_module(llama_debug, ["layers.1", "layers.2", "layers.3"])
    blocks = list(stage.layers.values())
    hooked = [bool(b._forward_pre_hooks or b._forward_hooks) for b in blocks]
    assert hooked == [True, False, True]  # the cut feeds the first block, takes the last
    assert plainest(blocks) is blocks[1]

    mesh = make_mesh(2, 2)
    trace_cache.clear()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = plan_stage(stage_request(stage, (X,), mesh, mixed_precision=bf16, activation_factor=1.0,
                                    microbatches_per_grad_reduce=4))
    planned = trace_stats()
    assert planned["misses"] == 1 and planned["uncached"] == 0  # one distinct block
    facts = stage_facts(stage, plan, mesh, (X,), 4)
    assert trace_stats()["misses"] == planned["misses"]
    assert trace_stats()["hits"] > planned["hits"]
    assert facts.from_graphs and facts.forward_s > 0
