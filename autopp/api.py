"""``pipeline_autoparallel``: split a model into stages, parallelize each over its sub-mesh,
and run them under a torch pipeline schedule."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp.backends import (
    AutoParallel,
    CompileOptions,
    Parallelize,
    ParallelizeFn,
    PipelineSpec,
    Planner,
    PlannerOptions,
    Replicate,
    StageBackend,
)
from autopp import adapters
from autopp.plan.options import changed_fields, refuse_loose
from autopp.mesh import check_world_mesh, mesh_sizes, stage_sub_mesh
from autopp.pipeline import Pipeline, PipelineLayout
from autopp.plan.keyword_inputs import example_keyword_inputs
from autopp.stage_split import build_stage_module, check_stage_forwards
from autopp.stage_split.build import is_model_input
from autopp.stage_split.model_inputs import InputReads, given_model_inputs, model_inputs_note
from autopp.stage_split.for_schedule import split_for_schedule, stage_ranks_of

if TYPE_CHECKING:  # torch's FSDP and pipelining cost ~1 s to import: only when used
    from autopp.plan.value import PipelinePlan

Split = int | str | Sequence[Sequence[str]] | None


def pipeline_autoparallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    example_inputs: Sequence[torch.Tensor],
    example_kwargs: Mapping[str, torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1F1B",
    n_microbatches: int,
    split: Split = None,
    parallelize: StageBackend | ParallelizeFn | Literal["auto", "autoparallel"] | None = "auto",
    ignore_index: int = -100,
    options: PlannerOptions | None = None,
    compile: bool | CompileOptions = False,
    raise_on_nonfinite: bool = True,
    layers_attr: str | None = None,
    plan: PipelinePlan | str | os.PathLike | None = None,
    **old_keywords: Any,
) -> Pipeline:
    """Pipeline ``model`` over ``mesh``: returns this rank's :class:`~autopp.pipeline.Pipeline`.

    ``model`` is the whole model on the meta device (each rank materialises only its own
    stages): a ModuleList/ModuleDict of repeated blocks (``layers_attr``, else found) between
    the modules before and after it, its forward run unchanged and cut at stage boundaries.
    ``split`` cuts it into stages, ``schedule`` places them on the "pp" ranks, and
    ``parallelize`` (default ``"auto"``: autopp's planner with ``options``; or a
    :class:`autopp.backends.StageBackend`, None, a callable or ``"autoparallel"``) shards each
    over its dp × tp sub-mesh; ``plan=`` runs a saved :class:`autopp.PipelinePlan` instead.

    Invariant: ``loss_fn`` returns the mean over a microbatch's counted tokens and autopp
    weights each microbatch by its share of the batch's, so loss and gradients equal the
    unpipelined model's. Every argument in full: docs/api.md.
    """
    refuse_loose("pipeline_autoparallel", old_keywords)
    backend = resolve_backend(parallelize, options=options, compile=compile, plan=plan)
    check_world_mesh(mesh)
    model_notes = adapters.prepare(model)  # e.g. a transformers model's attention
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
    keyword = example_keyword_inputs(example_kwargs, example_inputs)
    saved = backend.plan if isinstance(backend, Planner) else None
    saved_reads = saved is not None and any(is_model_input(n) for n, _, _ in
                                            saved.keyword_inputs)
    if saved is not None:  # before the split: its errors would hide what differs
        saved.check(model=model, pp=pp, dp=dp, tp=tp, schedule=str(schedule),
                    n_microbatches=n_microbatches, example_inputs=example_inputs,
                    keyword_inputs=given_model_inputs(keyword, example_inputs, saved_reads))
        if split is None:
            split = [list(f) for f in saved.fqns_per_stage]

    from autopp.schedules import stage_ids_for_rank

    local_batch = int(example_inputs[0].shape[0]) if example_inputs else None
    info, fqns_per_stage = split_for_schedule(
        model, schedule=schedule, split=split, pp=pp, n_microbatches=n_microbatches,
        local_batch_size=local_batch, layers_attr=layers_attr,
    )
    n_stages = len(fqns_per_stage)
    stage_ids = stage_ids_for_rank(pp_rank, pp, n_stages, info.style)
    sub_mesh = stage_sub_mesh(mesh)
    rank_of = stage_ranks_of(info, pp, n_stages)
    # every stage on meta, built once on this rank: checked, handed to the backend, built
    metas = tuple(build_stage_module(model, f, layers_attr=layers_attr, allow_tied=True)
                  for f in fqns_per_stage)
    if example_inputs:  # a forward that does not skip removed modules fails here, clearly
        x = example_inputs[0]
        mb = torch.empty((x.shape[0] // n_microbatches, *x.shape[1:]), dtype=x.dtype,
                         device="meta")
        # a forward that reads its input (GPT-2's shapes) runs on the model's inputs on
        # every stage: they become keyword inputs (autopp.stage_split.model_inputs)
        checked = InputReads(metas, (mb,))
        check_stage_forwards(checked.calls, (mb,))
        reads = checked.read
        if saved is not None and reads != saved_reads:
            raise ValueError(
                f"the plan was made for stages that {'' if saved_reads else 'do not '}take "
                f"the model's inputs, and this model's stages {'' if reads else 'do not'} "
                "read them (autopp.stage_split.model_inputs): plan it again for this model "
                "(drop plan=)")
        keyword = given_model_inputs(keyword, example_inputs, reads)
        if reads:
            model_notes = [*model_notes, model_inputs_note(example_inputs)]
    backend.prepare(PipelineSpec(
        model=model, fqns_per_stage=tuple(tuple(f) for f in fqns_per_stage),
        stage_ids=tuple(stage_ids), rank_of=rank_of, mesh=mesh, sub_mesh=sub_mesh,
        example_inputs=tuple(example_inputs), n_microbatches=n_microbatches, loss_fn=loss_fn,
        schedule=str(schedule), stage_modules=metas, keyword_inputs=tuple(keyword.items()),
    ))
    modules = [backend.build(s, metas[s], sub_mesh) for s in stage_ids]
    from autopp.tied import find_tied

    tied = find_tied(model, fqns_per_stage, layers_attr)
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
        model_notes=tuple(model_notes),
    )
    return Pipeline(layout=layout, stage_modules=modules, mesh=mesh, loss_fn=loss_fn,
                    ignore_index=ignore_index, backend=backend,
                    input_shapes=tuple(tuple(x.shape) for x in example_inputs),
                    raise_on_nonfinite=raise_on_nonfinite, tied=tied, rank_of=rank_of,
                    keyword_inputs=tuple((n, tuple(t.shape), str(t.dtype))
                                         for n, t in keyword.items()))


def resolve_backend(
    parallelize: StageBackend | ParallelizeFn | str | None, *,
    options: PlannerOptions | None = None, compile: bool | CompileOptions = False,
    plan: PipelinePlan | str | os.PathLike | None = None,
) -> StageBackend:
    """The :class:`~autopp.backends.StageBackend` for ``parallelize``, the planner's
    ``options`` (for ``"auto"``) and ``plan``; a ValueError naming the fix when one does not
    apply."""
    if plan is not None:
        if isinstance(parallelize, Planner):
            if parallelize.plan is not None:
                raise ValueError("a plan is given twice: as plan= and as Planner(plan=...); "
                                 "pass one")
            parallelize = Planner(parallelize.options, compile=parallelize.compile, plan=plan)
        elif parallelize != "auto":
            raise ValueError(f"plan= runs a planned pipeline and needs the planner "
                             f"(parallelize='auto' or a Planner), got parallelize={parallelize!r}")
    given = changed_fields(options) if options is not None else []
    if isinstance(parallelize, StageBackend):
        if options is not None or compile:
            named = (given or ["options"]) + (["compile"] if compile else [])
            raise ValueError(
                f"{named} are shorthands for parallelize='auto' (options= makes its "
                "Planner); with a backend object set them on it, e.g. "
                "Planner(PlannerOptions(...), compile=...)")
        return parallelize
    if parallelize == "auto":
        return Planner(options if options is not None else PlannerOptions(),
                       compile=compile, plan=plan)
    if compile:
        raise ValueError("compile needs the planner (parallelize='auto'): only planned stages "
                         "run as graphs")
    if options is not None and options.loss_parallel:
        raise ValueError("loss_parallel=True needs parallelize='auto'")
    mixed_precision = options.mixed_precision if options is not None else None
    if parallelize == "autoparallel":
        if any(f != "mixed_precision" for f in given):
            raise ValueError(f"parallelize='autoparallel' takes only mixed_precision of the "
                             f"planner's options, not {given}: leave them out")
        return AutoParallel(mixed_precision=mixed_precision)
    if mixed_precision is not None:
        raise ValueError(
            "mixed_precision needs parallelize='auto'; with your own parallelize, apply the "
            "policy there (e.g. fully_shard(..., mp_policy=...))"
        )
    if given:
        raise ValueError(f"options= (the planner's: {given}) needs parallelize='auto'; "
                         f"leave it out with parallelize={parallelize!r}")
    if parallelize is None:
        return Replicate()
    if callable(parallelize) and not isinstance(parallelize, str):
        return Parallelize(parallelize)
    raise TypeError(
        "parallelize must be a StageBackend, None, 'auto', 'autoparallel' or a callable, "
        f"got {parallelize!r}"
    )


