import math

import pytest
import torch

from autopp.sharding import plan_stage
from tests.harness.stage_request import stage_request
from autopp.sharding.chain.blocks import chain_dp
from autopp.sharding.ilp.solution import InfeasiblePlanError


class _R:
    def __init__(self, t):
        self.objective_s = t


def test_chain_dp_picks_cheapest_boundaries():
    A, B = ("A",), ("B",)
    table = {0: {(A, A): _R(5), (A, B): _R(1), (B, B): _R(1), (B, A): _R(10)}}
    assert chain_dp([0, 0, 0], table, [A], [A, B]) == [(A, B), (B, B), (B, B)]
    assert chain_dp([0, 0], table, [A], [A]) == [(A, A), (A, A)]
    with pytest.raises(InfeasiblePlanError):
        chain_dp([0], {0: {(A, B): _R(1)}}, [A], [A])


def test_block_stack_planned_once(stack_of, make_mesh):
    mesh = make_mesh(2, 4)
    x = torch.empty(8, 64, 256, device="meta")
    one = plan_stage(stage_request(stack_of(1), (x,), mesh))
    three = plan_stage(stage_request(stack_of(3), (x,), mesh))
    assert len(three.blocks) == 3 and len({b.signature for b in three.blocks}) == 1
    assert three.num_vars == one.num_vars  # one ILP model for all identical blocks
    assert math.isclose(three.step_time_s, 3 * one.step_time_s, rel_tol=1e-6)
    assert len(three.params) == 3 * len(one.params)
    assert three.params[0].fqn.startswith("layers.0.") and three.params[-1].fqn.startswith(
        "layers.2."
    )


def test_sequence_parallel_boundaries_are_candidates(llama_debug, make_mesh):
    from autopp._compat import sharding as compat
    from autopp.sharding.chain.blocks import boundary_candidates, trace_block

    traced = trace_block(llama_debug.layers["0"], torch.empty(8, 64, 256, device="meta"),
                         make_mesh(2, 4))
    cands = boundary_candidates(traced, ("dp", "tp"))
    assert (compat.Shard(0), compat.Replicate()) in cands
    assert (compat.Shard(0), compat.Shard(1)) in cands  # batch on dp, sequence on tp


def test_decoder_stage_planned_as_embedding_blocks_head(make_mesh):
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    from autopp.sharding import StagePlan

    cfg = build_decoder_config_for_backend(llama3_configs["debugmodel"], "sdpa")
    with torch.device("meta"):
        model = cfg.build()  # 6 identical blocks between embedding and head
    tokens = torch.zeros(8, 64, dtype=torch.long, device="meta")
    plan = plan_stage(stage_request(model, (tokens,), make_mesh(2, 2)))
    names = [b.prefix for b in plan.blocks]
    assert names == ["pre", *[f"layers.{i}" for i in range(6)], "post"]
    assert len({b.signature for b in plan.blocks}) == 3  # embedding, one block, head
    assert {p.fqn for p in plan.params} == {n for n, _ in model.named_parameters()}
    assert plan.input_placements == ("S(0)", "R") and plan.output_placements == ("S(0)", "R")
    assert StagePlan.from_json(plan.to_json()) == plan
