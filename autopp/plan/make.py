"""``parallelize="auto"``, planning side: what every stage of a pipeline runs as.

1. :func:`~autopp.plan.stage_inputs.stage_input_shapes` finds every stage's input (a microbatch, with the dp-global batch
   size the planner works in) by running the meta model stage by stage on meta tensors.
2. :func:`plan_boundaries` chooses the placement of every stage boundary and of the last
   stage's logits (loss parallel or not) by Alpa's objective
   (:func:`autopp.plan.boundaries.choose_boundaries`) on the stages' planned times, and
   :func:`~autopp.plan.local_stage.plan_local_stage` plans a stage on its sub-mesh under
   them (cached on disk, see :mod:`autopp.plan.cache`).
3. :func:`plan_whole_pipeline` puts them together into one
   :class:`~autopp.plan.value.PipelinePlan` (cached on disk whole); :func:`planned_stages`
   reads a rank's stages back out of it.

Shared by :func:`autopp.plan_pipeline`, :func:`autopp.pipeline_autoparallel` and
:func:`autopp.dry_run.dry_run`; the planned stage's runtime is :mod:`autopp.lower.stage`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp import adapters, tracing
from autopp.plan.cache import (
    cached_pipeline_plan,
    forward_code,
    pipeline_plan_key,
)
from autopp.plan.boundaries import BOUNDARIES, boundary_kinds, choose_boundaries
from autopp.plan.budgets import (
    budgets_less_fixed,
    fixed_stage_bytes,
    loss_kept_bytes,
    memory_budgets,
)
from autopp.schedules.comm_windows import schedule_windows
from autopp.schedules.memory_terms import communicator_bytes
from autopp.plan.loss_choice import describe_loss, loss_kinds, loss_time_s
from autopp.plan.objective import boundary_bytes, pp_link, pp_links, transfer_s
from autopp.plan.heap import frozen_heap
from autopp.plan.keyword_inputs import example_keyword_inputs, microbatch_keyword_inputs
from autopp.plan.local_stage import plan_local_stage
from autopp.plan.options import PlannerOptions, refuse_loose
from autopp.plan.parallel import map_stages
from autopp.plan.rank0 import plan_on_rank0
from autopp.plan.stage_inputs import last_stage_output, stage_meta_inputs
from autopp.plan.value import (
    PipelinePlan,
    PlanOptions,
    describe_inputs,
    model_fingerprint,
    model_structure,
)
from autopp.sharding import InfeasiblePlanError, StagePlan
from autopp.sharding.plan import describe_keyword_inputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlannedStage:
    """One local stage's plan and what it was planned with.

    Attributes:
        plan: the planner's StagePlan for the stage on its sub-mesh.
        example_inputs: meta tensors of one dp-global microbatch entering the stage.
        send_bytes: bytes this stage sends to the next one per microbatch, per device, in
            the chosen boundary placement; 0 for the last stage.
        boundary_out: the chosen placement of what it sends (a key of :data:`BOUNDARIES`);
            for the last stage, of its logits ("vocab": the loss runs in parallel over tp).
    """

    plan: StagePlan
    example_inputs: tuple[torch.Tensor, ...]
    send_bytes: int
    boundary_out: str = "batch"


def default_profile(device_type: str) -> str:
    """The device profile the planner assumes when none is given: the detected device's
    (:func:`autopp.profiles.devices.profile_for_device`)."""
    from autopp.profiles.devices import profile_for_device

    return profile_for_device(device_type)


def plan_boundaries(
    metas: Sequence[nn.Module],
    inputs: Sequence[tuple[torch.Tensor, ...]],
    sub_mesh: DeviceMesh,
    *,
    profile: str,
    budgets: Sequence[float | None],
    boundary: str = "auto",
    last_kinds: Sequence[str] = ("batch",),
    timings: dict[int, list] | None = None,
    mixed_precision: Any = None,
    n_microbatches: int = 1,
    rank_of: Sequence[int] | None = None,
    param_placements: Sequence[dict[str, tuple[str, ...]]] | None = None,
    memory: Sequence[dict[str, Any] | None] | None = None,
    pp: int | None = None,
    tf32: bool | None = None,
    keyword_inputs: Mapping[str, torch.Tensor] | None = None,
    schedule: str | None = None,
) -> tuple[list[str], Any]:
    """Choose every stage boundary's placement (and the last stage's logits placement).

    Args:
        metas / inputs: all stages on meta and their dp-global microbatch inputs.
        budgets: per-stage memory budget (None = none); or, with the whole memory
            counted (``memory``), a function of the chosen boundaries giving them (the
            receive buffers a stage holds depend on its boundaries' placements): the
            boundaries are then compared on unbudgeted plans and only ``plan_of`` plans
            under the budgets.
        boundary: "auto" (by cost), "batch" or "batch+seq" for every boundary.
        last_kinds: the last stage's output placements to compare (:func:`loss_kinds`);
            its time includes the loss's (:mod:`autopp.sharding.loss_cost`).
        timings: see :func:`plan_local_stage`.
        n_microbatches / rank_of: the pipeline's microbatches and each stage's pp rank, for
            Alpa's objective (see :func:`choose_boundaries`).
        mixed_precision: torch's ``MixedPrecisionPolicy`` (see :mod:`autopp.sharding.precision`);
            ``inputs`` must then already be in its ``param_dtype`` (:func:`~autopp.plan.stage_inputs.stage_input_shapes`).
        param_placements: per stage, parameters whose placement is fixed (tied copies).
        memory: per stage, the whole-memory accounting (see :func:`plan_local_stage`).
        keyword_inputs: the keyword inputs every stage takes (see :func:`plan_local_stage`).
        schedule: the pipeline's schedule, where its stages' once-per-step collectives run
            ahead (beside compute): with the whole memory counted, each stage is then
            planned under its budget against the windows the schedule leaves them
            (:func:`autopp.schedules.comm_windows.schedule_windows` over the unbudgeted
            plans; ``plan_stage(comm_windows_s=)``). None: every collective priced in full.

    Returns ``(bounds, plan_of)``: ``bounds[s]`` is the placement into stage ``s`` and
    ``bounds[s + 1]`` out of it (``len(metas) + 1`` entries), and ``plan_of(s)`` the stage's
    plan under them (from the on-disk cache once computed). Every rank computes the same
    ``bounds``: each plans (or reads from the cache) every stage under every choice.
    """

    dp, tp = sub_mesh["dp"].size(), sub_mesh["tp"].size()
    kinds = boundary_kinds(sub_mesh) if boundary == "auto" else (boundary,)
    if any(k not in BOUNDARIES or k == "vocab" for k in kinds):
        raise ValueError(f"boundary must be 'auto', 'batch' or 'batch+seq', got {boundary!r}")
    n = len(metas)
    ranks = list(rank_of) if rank_of is not None else list(range(n))
    mesh_shape = (pp or len(set(ranks)), dp, tp)
    logits = last_stage_output(metas, inputs, mixed_precision, keyword_inputs)

    whole = bool(memory) and any(m and m.get("activation_factor") is not None for m in memory)
    if callable(budgets) and not whole:
        raise ValueError("budgets as a function of the boundaries needs the whole memory "
                         "counted (memory=): boundaries are then compared unbudgeted")
    chosen: list[Sequence[float | None]] = [] if callable(budgets) else [budgets]

    def plan(s: int, k_in: str, k_out: str, budgeted: bool = True,
             windows: tuple[float, float] = (0.0, 0.0)) -> StagePlan:
        mem = memory[s] if memory else None
        if any(windows):
            mem = {**mem, "comm_windows_s": windows}
        return plan_local_stage(
            metas[s], inputs[s], sub_mesh, profile=profile,
            memory_budget_bytes=chosen[0][s] if budgeted else None,
            stage_index=s, boundary_in=k_in, boundary_out=k_out, timings=timings,
            mixed_precision=mixed_precision, n_microbatches=n_microbatches,
            param_placements=param_placements[s] if param_placements else None,
            memory=mem, tf32=tf32, keyword_inputs=keyword_inputs,
        )

    def loss_s(s: int, k_out: str) -> float:
        return loss_time_s(logits, sub_mesh, profile, k_out) if s == n - 1 else 0.0

    compared: dict[tuple[int, str, str], StagePlan] = {}  # the plans the boundaries compared

    def stage_time(s: int, k_in: str, k_out: str) -> float:
        # With the whole memory counted, boundaries are compared on each stage's
        # time-optimal plan (no budget: one solve per unit, no price search); only the
        # chosen boundaries are planned under the budget (plan_of). A parameter-only budget
        # is cheap to honour: it bounds the comparison too.
        try:
            p = compared[s, k_in, k_out] = plan(s, k_in, k_out, budgeted=not whole)
        except InfeasiblePlanError:  # e.g. a sequence tp does not divide: not a candidate
            return math.inf
        return p.step_time_s + loss_s(s, k_out)

    def send_time(s: int, kind: str) -> float:  # forward and back, between the ranks joined
        nbytes = boundary_bytes(inputs[s + 1][0], dp, tp, kind)
        if ranks[s] == ranks[s + 1]:
            return 0.0
        return (transfer_s(pp_link(profile, mesh_shape, ranks[s], ranks[s + 1]), nbytes)
                + transfer_s(pp_link(profile, mesh_shape, ranks[s + 1], ranks[s]), nbytes))

    if len(kinds) > 1 or len(last_kinds) > 1:
        bounds = choose_boundaries(n, kinds, stage_time, send_time, last_kinds,
                                   n_microbatches=n_microbatches, rank_of=rank_of)
    else:
        bounds = [kinds[0]] * n + [last_kinds[0]]
        bounds[0] = "batch"

    if math.isinf(sum(stage_time(s, bounds[s], bounds[s + 1]) for s in range(n))):
        for s in range(n):  # no feasible choice: raise the first stage's planner error
            plan(s, bounds[s], bounds[s + 1], budgeted=not whole)

    if not chosen:
        chosen.append(budgets(bounds))
    windows: list[tuple[float, float]] = [(0.0, 0.0)] * n
    if schedule is not None and whole:
        # the unbudgeted plans' times (cached: the boundaries were chosen on them), less
        # their once-per-step collectives, the last stage's with its loss
        fast = [compared.get((s, bounds[s], bounds[s + 1])) or
                plan(s, bounds[s], bounds[s + 1], budgeted=False) for s in range(n)]
        windows = schedule_windows(
            schedule, [p.step_time_s - sum(p.once_per_step_s()) + loss_s(s, bounds[s + 1])
                       for s, p in enumerate(fast)],
            pp=mesh_shape[0], n_microbatches=n_microbatches, stage_ranks=ranks,
            send_bytes=[boundary_bytes(inputs[s + 1][0], dp, tp, bounds[s + 1])
                        if s + 1 < n else 0 for s in range(n)],
            link=pp_link(profile, mesh_shape), links=pp_links(profile, mesh_shape, ranks))
        logger.info("once-per-step collectives' windows a step (gathers, reductions): %s",
                    ", ".join(f"stage {s} {w[0] * 1e3:.3g}/{w[1] * 1e3:.3g} ms"
                              for s, w in enumerate(windows)))

    def plan_of(s: int) -> StagePlan:
        p = plan(s, bounds[s], bounds[s + 1], windows=windows[s])
        if s == n - 1:  # the last stage's plan says how its loss runs
            p = dataclasses.replace(p, loss=describe_loss(bounds[-1]),
                                    loss_s=loss_s(s, bounds[-1]))
        return p

    return bounds, plan_of


def collectives_ahead(options: Any) -> bool:
    """Whether planned stages issue their once-per-step collectives ahead, beside compute
    (``StageGraphs.collectives_ahead``): with ``overlap_collectives`` on and weights gathered
    once per step (not per block: :class:`~autopp.graph.weight_gathering.WeightGathering`,
    the one home of that choice; per block, each graph issues its own ahead)."""
    from autopp.graph.weight_gathering import WeightGathering

    return (bool(options.overlap_collectives)
            and not WeightGathering.from_options(options).per_block)


def tied_placements(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]],
                    metas: Sequence[nn.Module], inputs: Sequence[tuple], sub_mesh,
                    budgets: Sequence[float | None],
                    memory: Sequence[dict[str, Any] | None] | None = None, **plan_kw: Any
                    ) -> list[dict[str, tuple[str, ...]]]:
    """Per stage, the placement every copy of a parameter tied across stages must have (the
    copies' gradients are summed shard by shard, :mod:`autopp.tied`): the one the planner
    chooses for it on the stage holding its first FQN, planned with batch boundaries."""
    from autopp.tied import find_tied

    fixed: list[dict[str, tuple[str, ...]]] = [{} for _ in metas]
    for t in find_tied(model, fqns_per_stage):
        home = next(s for s, fqn in t.stage_fqns if fqn == t.name)
        plan = plan_local_stage(metas[home], inputs[home], sub_mesh, stage_index=home,
                                memory_budget_bytes=budgets[home],
                                memory=memory[home] if memory else None, **plan_kw)
        pl = next(p.placements for p in plan.params if p.fqn == t.name)
        for s, fqn in t.stage_fqns:
            fixed[s][fqn] = tuple(pl)
    return fixed


def plan_whole_pipeline(
    model: nn.Module, *, pp: int, fqns_per_stage: Sequence[Sequence[str]],
    stage_ranks: Sequence[int], sub_mesh: DeviceMesh, schedule: str, n_microbatches: int,
    example_inputs: Sequence[torch.Tensor], options: Any, loss_fn: Any,
    budgets: Sequence[float | None] | None = None, timings: dict[int, list] | None = None,
    use_cache: bool = True, stage_modules: Sequence[nn.Module] | None = None,
    keyword_inputs: Mapping[str, torch.Tensor] | None = None,
    after_stage: Callable[[int, StagePlan, tuple[str, ...]], Any] | None = None,
    after_results: dict[int, Any] | None = None,
) -> tuple[PipelinePlan, bool]:
    """Plan every stage of a split pipeline into one :class:`~autopp.plan.value.PipelinePlan`
    (without estimates): tied parameters' placements, then boundaries and loss placement by
    Alpa's objective with each stage planned under them (:func:`plan_boundaries`).

    Args:
        model: the whole model on meta; ``fqns_per_stage`` its split, ``stage_ranks`` each
            stage's pp rank (of ``pp``), ``sub_mesh`` a stage's ("dp", "tp") sub-mesh
            (all have the same shape).
        schedule, n_microbatches: the pipeline's; ``example_inputs`` the model's inputs for
            one step on one dp rank.
        options: :class:`autopp.backends.PlannerOptions`; ``loss_fn`` the pipeline's loss
            (it decides whether the loss may run in parallel, :func:`loss_kinds`).
        budgets: per-stage parameter-memory budget; None: ``options.memory_budget_bytes``.
        timings: see :func:`plan_local_stage` (untouched when the whole plan is cached).
        use_cache: read and write the whole plan in the on-disk cache (stage plans are
            always cached).
        stage_modules: every stage of ``fqns_per_stage`` on meta, when the caller built them
            already (:func:`autopp.pipeline_autoparallel` does, once per rank); None: built
            here when the plan is not cached.
        keyword_inputs: keyword inputs of the model's forward for one step on one dp rank
            (by name, batch on dim 0, e.g. a padding ``attention_mask``): every stage takes
            them with each microbatch (planned unit by unit, as graph inputs).
        after_stage: ``after_stage(s, plan, boundaries)`` runs right after stage ``s`` is
            planned, in the process that planned it (the dry run costs each plan so, not
            after the slowest stage's plan); its results (picklable) go into
            ``after_results`` by stage. Not run where the whole plan is cached.

    Returns ``(plan, was_cached)``. The plan depends on nothing else (and the planning code,
    which :mod:`autopp.plan.cache` hashes into the key).
    """
    from autopp.profiles import get_profile

    # resolved: "measure" -> this machine's measured profile, by its own name
    profile = get_profile(options.profile or default_profile(sub_mesh.device_type)).name
    last_kinds = loss_kinds(sub_mesh, loss_fn, options.loss_parallel)
    record = PlanOptions.of(options, profile)
    n = len(fqns_per_stage)
    whole_memory = budgets is None and options.parameter_budget_bytes is None
    if budgets is None:
        budgets, memory = memory_budgets(options, profile, schedule, pp, n_microbatches,
                                         stage_ranks)
    else:  # explicit per-stage budgets: parameter bytes only (the dry run's comparisons)
        budgets, memory = list(budgets), None
    whole_budgets = budgets
    dp, tp = sub_mesh["dp"].size(), sub_mesh["tp"].size()
    fqns = tuple(tuple(f) for f in fqns_per_stage)
    fingerprint = model_fingerprint(model)
    mp = options.mixed_precision
    keyword = microbatch_keyword_inputs(keyword_inputs, n_microbatches, dp)

    def solve() -> PipelinePlan:
        # MoE dispatch, expert dtype; the collector off the imported heap while planning
        with tracing.settings(options.trace_settings()), frozen_heap():
            return _solve()

    def _solve() -> PipelinePlan:
        metas, inputs = stage_meta_inputs(model, fqns, example_inputs[0], n_microbatches, dp,
                                          record.compute_dtype, stage_modules, keyword)
        def budgets_at(bounds: Sequence[str] | None) -> list[float]:
            """The budgets less what the ILP's row does not count, with the receive
            buffers at ``bounds`` (None: every boundary at its largest kind)."""
            if not whole_memory:
                return list(whole_budgets)
            fixed = fixed_stage_bytes(metas, inputs, n_microbatches=n_microbatches, dp=dp,
                                      tp=tp, bounds=bounds)
            fixed[-1] += loss_kept_bytes(
                last_stage_output(metas, inputs, mp, keyword), dp, tp, last_kinds,
                memory[-1]["activation_factor"])
            return budgets_less_fixed(
                whole_budgets, fixed,
                communicator_bytes(get_profile(profile).communicator_bytes, (pp, dp, tp)),
                stage_ranks)

        # tied copies are placed before the boundaries are chosen: under the budgets with
        # every boundary at its largest kind (a bound that holds whatever is chosen)
        budgets = budgets_at(None)
        plan_kw = dict(profile=profile, mixed_precision=mp, n_microbatches=n_microbatches,
                       tf32=options.tf32, keyword_inputs=keyword)
        fixed = tied_placements(model, fqns, metas, inputs, sub_mesh, budgets, memory,
                                **plan_kw)
        bounds, plan_of = plan_boundaries(
            metas, inputs, sub_mesh, profile=profile,
            budgets=budgets_at if whole_memory else budgets, boundary=options.boundary,
            last_kinds=last_kinds, timings=timings, mixed_precision=mp,
            n_microbatches=n_microbatches, rank_of=list(stage_ranks), param_placements=fixed,
            memory=memory, pp=pp, tf32=options.tf32, keyword_inputs=keyword,
            schedule=str(schedule) if collectives_ahead(options) else None,
        )
        # under the chosen boundaries and each stage's budget, on worker processes where
        # this one can fork (plan/parallel.py)
        def planned(s: int) -> Any:
            p = plan_of(s)
            return p if after_stage is None else (p, after_stage(s, p, tuple(bounds)))

        done = map_stages(planned, n, timings=timings, progress=lambda k, n, t: logger.info(
            "stage %d/%d planned under its budget: %.1f s so far, %d to go", k, n, t, n - k))
        stage_plans = done if after_stage is None else tuple(p for p, _ in done)
        if after_stage is not None and after_results is not None:
            after_results.update({s: a for s, (_, a) in enumerate(done)})
        return PipelinePlan(
            model=fingerprint, model_structure=model_structure(model),
            pp=pp, dp=dp, tp=tp, schedule=str(schedule), n_microbatches=n_microbatches,
            input_shapes=tuple(tuple(int(d) for d in x.shape) for x in example_inputs),
            input_dtypes=tuple(str(x.dtype) for x in example_inputs),
            fqns_per_stage=fqns, stage_ranks=tuple(stage_ranks),
            stage_plans=stage_plans, boundaries=tuple(bounds),
            recompute=tuple(getattr(p, "recompute", "none") or "none" for p in stage_plans),
            tied_placements=tuple(tuple(sorted(d.items())) for d in fixed), options=record,
            stage_inputs=tuple(describe_inputs(x) for x in inputs),
            send_bytes=tuple(boundary_bytes(inputs[s + 1][0], dp, tp, bounds[s + 1])
                             if s + 1 < n else 0 for s in range(n)),
            keyword_inputs=describe_keyword_inputs(keyword_inputs),
        )

    if not use_cache:
        plan, hit = solve(), False
    else:
        plan, hit = _cached_solve(solve, {
            "model": fingerprint, "forward": forward_code(model), "pp": pp, "split": fqns,
            "stage_ranks": list(stage_ranks),
            "sub_mesh": [list(sub_mesh.shape), list(sub_mesh.mesh_dim_names)],
            "schedule": str(schedule), "n_microbatches": n_microbatches,
            "inputs": [[list(x.shape), str(x.dtype)] for x in example_inputs],
            **({"keyword_inputs": [[k, list(shape), d] for k, shape, d in
                                   describe_keyword_inputs(keyword_inputs)]}
               if keyword_inputs else {}),
            "options": dataclasses.asdict(record), "recompute": options.recompute,
            "last_kinds": list(last_kinds), "budgets": budgets, "memory": memory,
        })
    if options.strict:  # planned or cached: a fallback in either is refused
        plan.check_strict()
    return plan, hit


def _cached_solve(solve: Callable[[], PipelinePlan], fields: dict) -> tuple[PipelinePlan, bool]:
    """``solve()``'s plan through the on-disk cache under the key of ``fields``."""
    key = pipeline_plan_key(fields)
    t0 = time.perf_counter()
    plan, hit = cached_pipeline_plan(key, solve)
    plan = dataclasses.replace(plan, cache_entries=(key, *(
        p.cache_entry for p in plan.stage_plans if p.cache_entry)))
    logger.info("pipeline plan %s: %d stages in %.1f s (%s)", key[9:21], len(fields["split"]),
                time.perf_counter() - t0, "cached" if hit else "planned")
    return plan, hit


def planned_stages(plan: PipelinePlan, spec: Any) -> dict[int, PlannedStage]:
    """This rank's stages of ``plan`` for ``spec`` (a :class:`autopp.backends.PipelineSpec`),
    with the meta inputs the runtime lowers them for, as the plan records them (no meta
    forward). {stage id: PlannedStage}."""
    return {
        s: PlannedStage(plan=plan.stage_plans[s], example_inputs=plan.stage_example_inputs(s),
                        send_bytes=plan.send_bytes[s], boundary_out=plan.boundaries[s + 1])
        for s in spec.stage_ids
    }


def plan_pipeline(
    model: nn.Module,
    *,
    pp: int,
    dp: int = 1,
    tp: int = 1,
    schedule: str = "1F1B",
    n_microbatches: int,
    example_inputs: Sequence[torch.Tensor] | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    split: Any = None,
    layers_attr: str | None = None,
    options: PlannerOptions | None = None,
    loss_fn: Callable | None = None,
    mesh: DeviceMesh | None = None,
    example_kwargs: Mapping[str, torch.Tensor] | None = None,
    **old_keywords: Any,
) -> PipelinePlan:
    """Plan the whole pipeline of ``model`` (on meta) for a pp × dp × tp world.

    Args:
        model: the whole model on the meta device.
        pp, dp, tp, schedule, n_microbatches, split, layers_attr: as for
            :func:`autopp.pipeline_autoparallel`.
        example_inputs: the model's inputs for one step on one dp rank (only shapes and
            dtypes matter; meta tensors are fine); or give ``global_batch`` (all dp
            ranks) and ``seq_len`` for int64 token ids, as :func:`autopp.dry_run.dry_run`
            takes them (``global_batch_size=`` is refused with the new spelling).
        options: the planner's options, one :class:`autopp.PlannerOptions` value (loose
            planner keywords are refused with the ``options=`` to write); default: its
            defaults (the profile of the detected device: "CPU" on a cpu mesh).
        loss_fn: the loss the pipeline will run with; it decides whether the loss may run in
            parallel over tp. None: :func:`autopp.cross_entropy`.
        mesh: the ("pp", "dp", "tp") world mesh to plan on. None: one is built; without a
            process group the fake one is set up for pp·dp·tp ranks (and torn down after),
            so this works on one machine with no devices.
        example_kwargs: keyword inputs of the model's forward the steps will pass (name ->
            tensor for one step on one dp rank, dim 0 its batch, e.g. ``attention_mask``):
            planned as graph inputs of every stage and recorded in the plan, so a job
            running it (``pipeline_autoparallel(..., plan=)``) must pass the same ones.

    In a job (a real process group), call it on every rank: rank 0 plans, the others
    receive its plan. Plans are cached on disk (:mod:`autopp.plan.cache`).
    """
    refuse_loose("plan_pipeline", old_keywords, {"global_batch_size": "global_batch"})
    adapters.prepare(model)  # e.g. a transformers model's attention (logged)
    from autopp.stage_split import build_stage_module
    from autopp.stage_split.for_schedule import split_for_schedule, stage_ranks_of
    from autopp.stage_split.model_inputs import stage_keyword_inputs
    from autopp.loss import cross_entropy
    from autopp.mesh import build_world_mesh, init_fake_world, mesh_sizes, stage_sub_mesh

    if example_inputs is None:
        if global_batch is None or seq_len is None:
            raise ValueError("give example_inputs, or global_batch and seq_len")
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
        example_inputs = (torch.empty((global_batch // dp, seq_len), dtype=torch.long,
                                      device="meta"),)
    example_inputs = tuple(example_inputs)
    keyword = example_keyword_inputs(example_kwargs, example_inputs)
    options = options if options is not None else PlannerOptions()
    world = pp * dp * tp
    created = False
    if mesh is None:
        if not dist.is_initialized():
            init_fake_world(world)
            created = True
        elif dist.get_world_size() != world:
            raise ValueError(f"torch.distributed is initialised with {dist.get_world_size()} "
                             f"ranks, but pp={pp} x dp={dp} x tp={tp} needs {world}")
    try:
        if mesh is None:
            mesh = build_world_mesh(pp=pp, dp=dp, tp=tp)  # the backend's device type
        sizes = mesh_sizes(mesh)
        if (sizes["pp"], sizes["dp"], sizes["tp"]) != (pp, dp, tp):
            raise ValueError(f"mesh is pp={sizes['pp']} x dp={sizes['dp']} x tp={sizes['tp']}, "
                             f"not pp={pp} x dp={dp} x tp={tp}")
        info, fqns = split_for_schedule(
            model, schedule=schedule, split=split, pp=pp, n_microbatches=n_microbatches,
            local_batch_size=int(example_inputs[0].shape[0]), layers_attr=layers_attr)
        metas = [build_stage_module(model, list(f), allow_tied=True) for f in fqns]
        # a forward that reads its input (GPT-2's shapes) gets the model's inputs on every
        # stage, as keyword inputs (autopp.stage_split.model_inputs)
        keyword = stage_keyword_inputs(metas, example_inputs, n_microbatches, keyword)
        plan, _ = plan_on_rank0(lambda: plan_whole_pipeline(
            model, pp=pp, fqns_per_stage=fqns, stage_ranks=stage_ranks_of(info, pp, len(fqns)),
            sub_mesh=stage_sub_mesh(mesh), schedule=str(schedule),
            n_microbatches=n_microbatches, example_inputs=example_inputs, options=options,
            loss_fn=loss_fn if loss_fn is not None else cross_entropy,
            keyword_inputs=keyword or None, stage_modules=metas))
    finally:
        if created:
            dist.destroy_process_group()
    return plan
