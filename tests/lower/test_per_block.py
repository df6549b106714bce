"""Weights gathered and gradients reduced block by block (autopp.graph.per_block), read off
a planned stage's rewritten graphs on the fake process group. The values are checked
against single-process torch by the 8-rank pipelines of
tests/pipeline/test_auto_pipeline.py::test_auto_weights_gathered_and_gradients_reduced_per_block."""

from __future__ import annotations

import pytest

from autopp.graph.overlap import is_collective
from autopp.graph.per_block import (KIND_META, block_collectives, blocks_in_flight,
                                    per_block_stage_graphs)

from tests.lower.test_lower import _planned_units


@pytest.fixture(scope="module")
def stage(make_mesh, stack_of):
    """A four-block stage planned at dp2 x tp2 under a quarter of its parameter bytes
    (weights dp-sharded), lowered and split as a pipeline runs it; and each parameter's
    block."""
    from autopp.lower.local_graphs import lower_stage, split_local

    plan, units, ends = _planned_units(stack_of(4), make_mesh(2, 2))
    graphs = split_local(lower_stage(units, make_mesh(2, 2), *ends))
    blocks = tuple(k for k, u in enumerate(units) for _ in u.joint.params)
    return graphs, blocks


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_per_block_graphs_hold_prefetch_plus_one_blocks(stage, prefetch):
    """The forward and the backward-input graphs gather every weight the unshard graph
    gathered, at most ``prefetch + 1`` blocks alive at once; the forward saves shards and
    activations, never a gathered weight; the backward-weight and full backward graphs run
    every reduction of the reduce-grad graph, once; no unshard or reduce-grad graph is
    left (UNSHARD hands the shards on, REDUCE_GRAD is the identity)."""
    graphs, blocks = stage
    assert graphs.unshard_graph is not None and graphs.reduce_grad_graph is not None
    pb = per_block_stage_graphs(graphs, blocks, prefetch=prefetch)
    assert pb.unshard_graph is None and pb.reduce_grad_graph is None
    n_unshard = sum(map(is_collective, graphs.unshard_graph.graph.nodes))
    n_reduce = sum(map(is_collective, graphs.reduce_grad_graph.graph.nodes))
    gathering_blocks = len({n.meta["autopp_block"] for n in pb.forward_graph.graph.nodes
                            if n.meta.get(KIND_META) == "gather"})
    assert gathering_blocks == 4
    for name in ("forward", "backward_input", "full_backward"):
        gm = pb.graphs()[name]
        assert blocks_in_flight(gm) == min(prefetch + 1, gathering_blocks), name
    # each weight gathered once in F and once again in I (forward ∪ backward frontier)
    assert (block_collectives(pb.forward_graph, "gather")
            + block_collectives(pb.backward_input_graph, "gather")) >= n_unshard
    assert block_collectives(pb.backward_weight_graph, "reduce") == n_reduce
    assert block_collectives(pb.full_backward_graph, "reduce") == n_reduce
    assert block_collectives(pb.backward_weight_graph, "gather") == 0
    sig = pb.convention.signature
    saved = pb.forward_graph.graph.output_node().args[0][sig.num_outputs:]
    assert not [v.name for v in saved if v.name.startswith("blk_")]
    assert pb.convention.num_saved_for_backward == len(saved)


def test_per_block_prefetch_is_a_number_of_blocks(stage):
    graphs, blocks = stage
    with pytest.raises(ValueError, match="prefetch is a number of blocks"):
        per_block_stage_graphs(graphs, blocks, prefetch=-1)
    with pytest.raises(ValueError, match="give one per flat parameter"):
        per_block_stage_graphs(graphs, blocks[:-1])


def test_reshard_after_forward_is_retired():
    from autopp.plan.options import PlannerOptions

    with pytest.raises(ValueError, match="weight_gathering='per_block'"):
        PlannerOptions(reshard_after_forward=True)
    with pytest.raises(ValueError, match="weight_gathering must be"):
        PlannerOptions(weight_gathering="per_microbatch")
