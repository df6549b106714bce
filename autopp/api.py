"""``pipeline_autoparallel``: split a model into stages, parallelize each over its sub-mesh,
and run them under a torch pipeline schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopp.auto_plan import (
    PlannedStage,
    agree_on_plans,
    boundary_bytes,
    default_profile,
    loss_kinds,
    plan_pipeline,
    stage_input_shapes,
)
from autopp.mesh import check_world_mesh, mesh_sizes, stage_sub_mesh
from autopp.pipeline import ParallelizeFn, Pipeline, PipelineLayout
from autopp.schedules import (
    ScheduleInfo,
    check_schedule_config,
    default_n_stages,
    schedule_info,
    stage_ids_for_rank,
)
from autopp.stage_split import build_stage_module, resolve_split

Split = int | str | Sequence[Sequence[str]] | None


def pipeline_autoparallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1F1B",
    n_microbatches: int,
    split: Split = None,
    parallelize: ParallelizeFn | Literal["auto", "autoparallel"] | None = "auto",
    ignore_index: int = -100,
    profile: str | None = None,
    memory_budget_bytes: float | None = None,
    boundary: Literal["auto", "batch", "batch+seq"] = "auto",
    loss_parallel: bool | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
) -> Pipeline:
    """Pipeline ``model`` over ``mesh``: returns this rank's :class:`~autopp.pipeline.Pipeline`.

    Args:
        model: the whole model on the meta device (never materialised whole). Its body is a
            ``layers`` ModuleList/ModuleDict with modules before it (embedding) and after it
            (norm, head); its forward must skip modules set to None (torchtitan's decoders do).
        mesh: the world mesh with dims ("pp", "dp", "tp"), from :func:`autopp.build_world_mesh`.
            Each pipeline rank's stages live on its sub-mesh (dp × tp).
        example_inputs: the model's positional inputs for one step on this dp rank (the local
            batch, batch on dim 0); used to check the batch against the microbatch count.
        loss_fn: ``loss_fn(output, target)`` returning the MEAN loss over the microbatch's
            counted tokens (targets equal to ``ignore_index`` do not count), as
            ``F.cross_entropy(..., ignore_index=...)`` does. autopp weights each microbatch by
            its share of the global batch's counted tokens, so the loss and gradients equal
            the unpipelined model's.
        schedule: a torch schedule name (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
            InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) or a path to a CSV schedule.
        n_microbatches: microbatches per step; must divide the local batch size.
        split: how to cut the model into stages: None (uniform over layers, with embedding
            and head weighted as one layer each; as many stages as the schedule places on
            pp ranks), an int (that many uniform stages), a layout string such as
            ``"Ettt|tttL"`` (see :mod:`autopp.stage_split`), or explicit module FQNs per stage.
        parallelize: ``"auto"`` (default: the sharding planner chooses each stage's
            placements over its sub-mesh, see :mod:`autopp.sharding`; plans are cached on
            disk), None (each stage replicated over its sub-mesh, gradients averaged over
            dp), or a callable ``(stage_module, sub_mesh) -> module`` applying your own
            parallelism (e.g. torchtitan's TP + FSDP). It receives the stage on the meta
            device and must average gradients over dp (the FSDP/DDP default).
            ``"autoparallel"`` plans each stage with meta's AutoParallel instead of autopp's
            planner, when it is installed (see :mod:`autopp.sharding.autoparallel_backend`).
        ignore_index: target value that does not count towards the loss.
        profile: with ``"auto"``, the device profile the planner's cost model assumes
            ("H100", "H200", "A100", "CPU"); default: "CPU" on a cpu mesh, else "H100".
        memory_budget_bytes: with ``"auto"``, per-device bound on parameter memory.
        boundary: with ``"auto"``, the placement of activations sent between stages:
            "auto" (chosen by the planner's cost: stage times plus transfer time), "batch"
            (batch split over dp, whole over tp) or "batch+seq" (sequence also split over
            tp: 1/tp of the bytes).
        loss_parallel: with ``"auto"`` and ``loss_fn=autopp.cross_entropy``, whether the
            last stage leaves its logits split on the vocabulary over tp and computes the
            loss in parallel (torch's ``loss_parallel``) instead of gathering them: None
            (default: chosen by the planner's cost), True (always) or False (never).
            ``describe()`` says which was chosen.
        mixed_precision: with ``"auto"``, torch's FSDP2 ``MixedPrecisionPolicy``: e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
            computes with bf16 parameters (gathered in bf16) and bf16 activations between
            stages, and reduces parameter gradients in fp32 into the fp32 masters the
            optimizer updates. None: the parameters' own dtype throughout.
    """
    if parallelize not in (None, "auto", "autoparallel") and not callable(parallelize):
        raise TypeError(
            f"parallelize must be None, 'auto', 'autoparallel' or a callable, got {parallelize!r}"
        )
    check_world_mesh(mesh)
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "pipeline_autoparallel expects the model on the meta device (build it under "
            "`with torch.device('meta'):`); each rank materialises only its own stages"
        )
    sizes = mesh_sizes(mesh)
    pp, dp, tp = sizes["pp"], sizes["dp"], sizes["tp"]
    coords = mesh.get_coordinate()
    if coords is None:
        raise ValueError("this rank is not part of the mesh")
    pp_rank, dp_rank, tp_rank = coords

    local_batch = int(example_inputs[0].shape[0]) if example_inputs else None
    info, fqns_per_stage = split_for_schedule(
        model, schedule=schedule, split=split, pp=pp, n_microbatches=n_microbatches,
        local_batch_size=local_batch,
    )
    n_stages = len(fqns_per_stage)
    stage_ids = stage_ids_for_rank(pp_rank, pp, n_stages, info.style)

    sub_mesh = stage_sub_mesh(mesh)
    modules = []
    auto_plans = None
    if parallelize == "auto":
        rank_of = [next(r for r in range(pp)
                        if s in stage_ids_for_rank(r, pp, n_stages, info.style))
                   for s in range(n_stages)]
        auto_plans = _plan_stages(
            model, fqns_per_stage, stage_ids, sub_mesh, example_inputs, n_microbatches, dp,
            rank_of=rank_of,
            profile=profile or default_profile(mesh.device_type),
            memory_budget_bytes=memory_budget_bytes, boundary=boundary,
            last_kinds=loss_kinds(sub_mesh, loss_fn, loss_parallel),
            mixed_precision=mixed_precision,
        )
    elif loss_parallel:
        raise ValueError("loss_parallel=True needs parallelize='auto'")
    elif parallelize == "autoparallel":
        from autopp.sharding.autoparallel_backend import autoparallel_stage

        _, ap_inputs = _meta_stage_inputs(model, fqns_per_stage, example_inputs,
                                          n_microbatches, dp)
    elif mixed_precision is not None:
        raise ValueError(
            "mixed_precision needs parallelize='auto'; with your own parallelize, apply the "
            "policy there (e.g. fully_shard(..., mp_policy=...))"
        )
    for s in stage_ids:
        m = build_stage_module(model, fqns_per_stage[s])
        if parallelize == "autoparallel":
            m = autoparallel_stage(m, sub_mesh, ap_inputs[s], mixed_precision)
        elif callable(parallelize):
            m = parallelize(m, sub_mesh)
        modules.append(m)

    layout = PipelineLayout(
        schedule=str(schedule),
        n_stages=n_stages,
        n_microbatches=n_microbatches,
        fqns_per_stage=tuple(tuple(f) for f in fqns_per_stage),
        stage_ids=tuple(stage_ids),
        pp_rank=pp_rank,
        pp_size=pp,
        dp_rank=dp_rank,
        dp_size=dp,
        tp_rank=tp_rank,
        tp_size=tp,
    )
    return Pipeline(
        layout=layout,
        stage_modules=modules,
        mesh=mesh,
        loss_fn=loss_fn,
        ignore_index=ignore_index,
        replicated=parallelize is None,
        auto_plans=auto_plans,
    )


def _meta_stage_inputs(model, fqns_per_stage, example_inputs, n_microbatches, dp,
                       compute_dtype=None):
    """All stages on meta and their inputs for one dp-global microbatch (what planners see)."""
    x = example_inputs[0]
    mb = x.shape[0] // n_microbatches * dp
    first = (torch.empty((mb, *x.shape[1:]), dtype=x.dtype, device="meta"),)
    metas = [build_stage_module(model, f) for f in fqns_per_stage]
    return metas, stage_input_shapes(metas, first, compute_dtype)


def split_for_schedule(
    model: nn.Module, *, schedule: str, split: Split, pp: int, n_microbatches: int,
    local_batch_size: int | None,
) -> tuple[ScheduleInfo, list[list[str]]]:
    """The schedule's rules and the model's stages (module FQNs per stage), checked together.

    ``split=None`` gives as many uniform stages as the schedule places on ``pp`` ranks; an
    int gives that many uniform stages. Raises ValueError for a split, microbatch count or
    batch size the schedule cannot run.
    """
    info = schedule_info(schedule)
    n_stages = default_n_stages(schedule, pp) if split is None else None
    if isinstance(split, int) and not isinstance(split, bool):
        n_stages = split
    fqns_per_stage = resolve_split(model, split, n_stages)
    check_schedule_config(
        schedule, pp=pp, n_stages=len(fqns_per_stage), n_microbatches=n_microbatches,
        local_batch_size=local_batch_size,
    )
    return info, fqns_per_stage


def _plan_stages(model, fqns_per_stage, stage_ids, sub_mesh, example_inputs, n_microbatches, dp,
                 *, profile, memory_budget_bytes, boundary="auto", last_kinds=("batch",),
                 mixed_precision=None, rank_of=None):
    """Plan this rank's stages; returns {stage id: PlannedStage}."""
    metas, inputs = _meta_stage_inputs(
        model, fqns_per_stage, example_inputs, n_microbatches, dp,
        mixed_precision.param_dtype if mixed_precision is not None else None)
    tp = sub_mesh["tp"].size()
    bounds, plan_of = plan_pipeline(
        metas, inputs, sub_mesh, profile=profile,
        budgets=[memory_budget_bytes] * len(metas), boundary=boundary, last_kinds=last_kinds,
        mixed_precision=mixed_precision, n_microbatches=n_microbatches, rank_of=rank_of,
    )
    plans = agree_on_plans([plan_of(s) for s in stage_ids], sub_mesh)
    return {
        s: PlannedStage(
            plan=p, example_inputs=inputs[s],
            send_bytes=boundary_bytes(inputs[s + 1][0], dp, tp, bounds[s + 1])
            if s + 1 < len(inputs) else 0,
            boundary_out=bounds[s + 1],
        )
        for s, p in zip(stage_ids, plans)
    }
