"""``parallelize="auto"``, runtime side: a planned stage as a graph stage of the pipeline.

:func:`materialize_and_apply` creates the stage's parameters shard by shard in the planned
placements, initialises them and applies the plan; :func:`planned_graph_stage` lowers the
stage to one local joint graph, has :mod:`autopp.graph` split it (recomputing as
``PlannerOptions.recompute`` says) and makes it an :class:`autopp.graph.GraphStage`, which
torch's runtime drives action by action, weights gathered and gradients reduced as the
weight-gathering policy says (:mod:`autopp.graph.weight_gathering`). Stages exchange local
tensors in the plan's boundary placements. :func:`fqn_view` gives the planned parameters back
their whole-model names, for optimizers, state dicts and checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp.graph import GraphStage, Recompute, StageGraphs
from autopp.graph.weight_gathering import WeightGathering
from autopp.init import init_module_
from autopp.sharding import StagePlan
from autopp.lower.apply import ShardedStage, apply_plan, empty_sharded_


def materialize_and_apply(
    stage_meta: nn.Module, plan: StagePlan, sub_mesh: DeviceMesh,
    example_inputs: tuple[torch.Tensor, ...], *, seed: int, device: torch.device,
    recompute: Recompute = "none", overlap_collectives: bool = True,
) -> ShardedStage:
    """Create the stage's parameters shard by shard in the planned placements, initialise
    them (split-independent init: each parameter's full value exists only while it is
    initialised and sharded), then apply the plan. ``recompute``: what the stage's backward
    pieces recompute instead of saving (:mod:`autopp.graph.recompute`), for every graph
    :meth:`ShardedStage.stage_graphs` makes (and so the pipeline runs);
    ``overlap_collectives``: whether those graphs issue collectives early and wait for them
    at first use (:mod:`autopp.graph.overlap`)."""
    import copy

    stage = empty_sharded_(copy.deepcopy(stage_meta), plan, sub_mesh, device)
    # buffers (e.g. RoPE caches) are small: init_module_ materialises them whole and has
    # their modules recompute them (still on meta, so it knows they hold no values yet)
    init_module_(stage, seed=seed, device=device)
    sharded = apply_plan(stage, plan, sub_mesh, example_inputs)
    sharded.recompute = recompute
    sharded.overlap_collectives = overlap_collectives
    return sharded


def planned_stage_graphs(
    sharded: ShardedStage, *, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    compile: Any = False, gathering: WeightGathering = WeightGathering(),
) -> StageGraphs:
    """The planned stage's split graphs as a pipeline runs them (recomputing as
    ``sharded.recompute`` says; ``compile``: False, True or
    :class:`autopp.backends.CompileOptions`: Inductor): local tensors in and out
    (shaped like one microbatch; the plan's keyword inputs, this rank's slice of the
    microbatch's, taken by name), parameters handed in as local shards and gradients
    returned as DTensors like their parameters (``state_as_local_shards``), and on the last
    stage ``loss_fn`` run eagerly on the local output."""
    local, graphs = sharded.stage_graphs()
    if gathering.per_block:
        graphs = sharded.per_block_graphs(gathering.prefetch)
    n_state = local.signature.num_state_inputs
    placeholders = list(local.gm.graph.find_nodes(op="placeholder"))
    x_dtype = placeholders[n_state].meta["val"].dtype
    out_dtype = placeholders[-1].meta["val"].dtype  # the output gradient's
    graphs = dataclasses.replace(
        graphs,
        state_as_local_shards=True,
        # overlap on: UNSHARD's gathers and REDUCE_GRAD's reductions run under compute
        collectives_ahead=sharded.overlap_collectives,
        input_meta=(torch.empty(local.input_shapes[n_state], dtype=x_dtype, device="meta")
                    .requires_grad_(bool(local.signature.input_grad_indices)),),
        # torch's stage allocates gradient buffers only for values that require grad
        output_meta=(torch.empty(local.input_shapes[-1], dtype=out_dtype, device="meta")
                     .requires_grad_(True),),
        runners={},
        keyword_inputs=tuple(name for name, _, _ in sharded.plan.keyword_inputs),
    )
    if compile:
        compile_graphs(graphs, compile)
    if loss_fn is not None:
        graphs = graphs.with_eager_loss(loss_fn)
    return graphs


def compile_graphs(graphs: StageGraphs, compile: Any) -> StageGraphs:
    """Compile every callable of ``graphs`` with Inductor: ``compile`` is True (Inductor's
    defaults) or an :class:`autopp.backends.CompileOptions` (its ``inductor_options()``;
    duck-typed: that class sits on the plan floor, above this one)."""
    from autopp.graph import compile_stage_graphs

    opts = compile.inductor_options() if hasattr(compile, "inductor_options") else None
    return compile_stage_graphs(graphs, options=opts)


def planned_graph_stage(
    sharded: ShardedStage, *, stage_index: int, num_stages: int, device: torch.device,
    group, loss_fn: Callable | None, compile: Any = False,
    gathering: WeightGathering = WeightGathering(),
) -> GraphStage:
    """:class:`autopp.graph.GraphStage` running the planned stage ``sharded`` (see
    :func:`planned_stage_graphs`; ``loss_fn`` only on the last stage)."""
    is_last = stage_index == num_stages - 1
    graphs = planned_stage_graphs(sharded, loss_fn=loss_fn if is_last else None, compile=compile,
                                  gathering=gathering)
    return GraphStage(sharded, graphs, stage_index=stage_index, num_stages=num_stages,
                      device=device, group=group)


def fqn_view(named: Sequence[tuple[str, nn.Parameter]],
             buffers: Sequence[tuple[str, torch.Tensor, bool]] = ()) -> nn.Module:
    """A module tree holding ``named`` parameters and ``buffers`` (FQN, tensor, persistent)
    under their FQNs (the same objects)."""
    root = nn.Module()

    def parent(fqn: str) -> tuple[nn.Module, str]:
        *path, leaf = fqn.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        return mod, leaf

    for fqn, p in named:
        mod, leaf = parent(fqn)
        mod.register_parameter(leaf, p)
    for fqn, b, persistent in buffers:
        mod, leaf = parent(fqn)
        mod.register_buffer(leaf, b, persistent=persistent)
    return root
