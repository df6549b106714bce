"""Dry run: plan a whole pipeline for pp × dp × tp ranks on one machine, with no devices
(``dry_run(model_meta, pp=, dp=, tp=, schedule=, n_microbatches=, global_batch=, seq_len=,
options=PlannerOptions(profile="H100"))``).

On the fake process group (:func:`autopp.mesh.init_fake_world`), the model is split as
:func:`autopp.pipeline_autoparallel` splits it and every stage (not only one rank's) is
planned by the same code (:func:`autopp.plan.make.plan_whole_pipeline`, through the on-disk
plan cache); all stage sub-meshes share rank 0's shape. Each plan becomes the simulator's
:class:`~autopp.schedules.StageCost` (:mod:`autopp.estimate`) and the pipeline's own schedule
is simulated over them: the step, the bubble and each rank's peak memory by category are the
simulator's (Alpa's closed formula beside it), each peak checked against the profile's
memory less a reserve. :attr:`DryRunReport.plan` is the :class:`~autopp.plan.value.PipelinePlan`
a job would run, with the estimates added (``report.plan.save(path)``, then
``pipeline_autoparallel(..., plan=path)`` runs it without planning).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopp.stage_split.for_schedule import split_for_schedule, stage_ranks_of
from autopp.plan.boundaries import BOUNDARIES
from autopp.plan.keyword_inputs import example_keyword_inputs, microbatch_keyword_inputs
from autopp.plan.heap import frozen_heap
from autopp.plan.make import PipelineRequest, loss_time_s, plan_whole_pipeline
from autopp.plan.parallel import map_stages
from autopp.plan.stage_inputs import last_stage_output, stage_meta_inputs
from autopp.stage_split import build_stage_module
from autopp.stage_split.model_inputs import stage_keyword_inputs
from autopp.backends import PlannerOptions
from autopp.plan.options import refuse_loose
from autopp.format import compact_modules
from autopp.dry_run.format import format_report
from autopp.sharding.report import placement_summary
from autopp.estimate.stage_costs import (
    StageFacts,
    full_checkpointing_cost,
    pipeline_estimates,
    simulated_step_s,
)
from autopp import tracing
from autopp.loss import cross_entropy
from autopp.mesh import build_world_mesh, init_fake_world, stage_sub_mesh
from autopp.estimate.pipeline import simulate_stages, stage_estimate
from autopp.graph.weight_gathering import WeightGathering
from autopp.plan.objective import (
    boundary_bytes,
    pipeline_objective_s,
    pp_link,
    pp_links,
    slowest_link,
)
from autopp.plan.value import PipelinePlan
from autopp.plan.cache import cached_plan
from autopp.plan.local_stage import StageTiming
from autopp.schedules import (
    Link,
    SimulationResult,
    StageCost,
    write_chrome_trace,
    write_timeline_png,
)
from autopp.sharding import StagePlan, StageRequest, plan_stage
from autopp.profiles import get_profile
from autopp.adapters.torchtitan_reference import torchtitan_stage_placements

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class StageReport:
    """One stage of a dry run."""

    index: int
    pp_rank: int
    modules: str
    """Compact module list, e.g. ``tok_embeddings, layers.0-7``."""
    input_shapes: tuple[tuple[int, ...], ...]
    """dp-global microbatch shapes entering the stage (what the planner sees)."""
    plan: StagePlan
    plan_wall_s: float
    cached: bool
    send_shape: tuple[int, ...] | None
    """Shape of the activation sent to the next stage, local to one device (in the placement
    :attr:`boundary_out`); None for the last stage."""
    send_bytes: int
    """Bytes one device sends to the next stage per microbatch (0 for the last stage)."""
    cost: StageCost
    """What the schedule simulator runs for this stage (:mod:`autopp.estimate`)."""
    facts: StageFacts
    """The plan's time by runtime piece and its graph-read memory."""
    torchtitan: StagePlan | None = None
    torchtitan_wall_s: float = 0.0
    torchtitan_cached: bool = False
    torchtitan_cost: StageCost | None = None
    boundary_out: str = "batch"
    """Placement of what the stage sends (a key of ``autopp.plan.boundaries.BOUNDARIES``); for the
    last stage, of its logits ("vocab": loss parallel)."""
    loss_s: float = 0.0
    """Last stage: estimated fwd+bwd time of the loss on one microbatch (0 elsewhere)."""
    torchtitan_loss_s: float = 0.0
    reused_from: int | None = None
    """The stage whose plan this one reuses (alike units, boundaries and budget class:
    :mod:`autopp.plan.stage_classes`); None: planned itself (or read from the cache)."""

    @property
    def time_s(self) -> float:
        """Estimated fwd+bwd time of one microbatch on one device (the loss included)."""
        return self.plan.step_time_s + self.loss_s

    @property
    def activation_bytes(self) -> int | None:
        """Bytes one microbatch keeps on a device between its forward and backward on this
        stage (read off the lowered graphs); None if not computed."""
        return self.facts.activation_bytes


@dataclass(frozen=True)
class DryRunReport:
    """A planned pipeline: per-stage plans and the pipeline's estimates. ``str()`` prints it."""

    pp: int
    dp: int
    tp: int
    schedule: str
    n_microbatches: int
    global_batch: int
    seq_len: int
    profile: str
    memory_budget_bytes: float | None
    stages: tuple[StageReport, ...]
    stage_ids_per_rank: tuple[tuple[int, ...], ...]
    simulation: SimulationResult
    """The schedule simulated over the stages' costs: the step estimate, bubble, memory."""
    link: Link
    """The slowest of the pp links the simulation used (each send goes over the link between
    the two ranks it joins: intra-node where they share a node)."""
    device_memory_bytes: float
    """The profile's device memory."""
    memory_reserve: float
    """Fraction of the device memory kept back (see :attr:`usable_bytes`)."""
    compare: bool = False
    compare_notes: tuple[str, ...] = field(default=())
    mixed_precision: str | None = None
    """The policy, as text (None: full precision)."""
    torchtitan_simulation: SimulationResult | None = None
    checkpointed_simulation: SimulationResult | None = None
    """The same schedule with full activation checkpointing per block (an estimate; None
    without graphs)."""
    checkpoint_working_bytes: tuple[int, ...] = ()
    """Per pp rank: one block's saved activations, live while it is recomputed (added to
    :attr:`checkpointed_simulation`'s peaks)."""
    wall_s: float = 0.0
    """Seconds the whole dry run took (planning, lowering, simulation)."""
    plan: PipelinePlan | None = None
    """The pipeline's plan, as :func:`autopp.pipeline_autoparallel` would run it, with the
    simulated estimates (``plan.save(path)``; run it with ``plan=path``)."""
    distinct_plans: int = 0
    """Stage plans made under a budget, one per class of alike stages (the others reuse
    them); 0 where the whole plan came from the cache."""

    # ---- pipeline figures -------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def microbatch_rows(self) -> int:
        """Rows of one microbatch on one dp rank."""
        return self.global_batch // self.dp // self.n_microbatches

    def rank_times_s(self, which: str = "planned") -> list[float]:
        t = self._times(which)
        return [sum(t[s] for s in ids) for ids in self.stage_ids_per_rank]

    def _times(self, which: str) -> list[float]:
        if which == "planned":
            return [s.time_s for s in self.stages]
        return [s.torchtitan.step_time_s + s.torchtitan_loss_s  # type: ignore[union-attr]
                for s in self.stages]

    def alpa_time_s(self, which: str = "planned") -> float:
        """Alpa's closed formula, whatever the schedule: Σ_s t_s + (M − 1) · slowest rank's
        Σ t_s (one microbatch each)."""
        rank_of = {s: r for r, ids in enumerate(self.stage_ids_per_rank) for s in ids}
        return pipeline_objective_s(self._times(which), self.n_microbatches,
                                    [rank_of[s] for s in range(len(self.stages))])

    def simulation_of(self, which: str = "planned") -> SimulationResult:
        sim = self.simulation if which == "planned" else self.torchtitan_simulation
        if sim is None:
            raise ValueError("no torchtitan simulation: run the dry run with compare=True")
        return sim

    def costs_of(self, which: str = "planned") -> list[StageCost]:
        return [s.cost if which == "planned" else s.torchtitan_cost for s in self.stages]

    @property
    def step_time_s(self) -> float:
        """The simulated step time of the pipeline's schedule (on a measured CPU profile
        whose ranks share the cores, contended: :func:`autopp.estimate.contended_step_s`)."""
        return simulated_step_s(self.simulation, self.profile, self.pp * self.dp * self.tp)

    @property
    def bubble_fraction(self) -> float:
        return self.simulation.bubble_fraction

    @property
    def torchtitan_step_time_s(self) -> float | None:
        return simulated_step_s(self.torchtitan_simulation, self.profile,
                                self.pp * self.dp * self.tp) if self.compare else None

    @property
    def step_time_ratio(self) -> float | None:
        """planned / torchtitan simulated step time (below 1: planned is faster)."""
        tt = self.torchtitan_step_time_s
        return None if not tt else self.step_time_s / tt

    @property
    def usable_bytes(self) -> float:
        """Device memory minus the reserve: what each rank's simulated peak must fit."""
        return self.device_memory_bytes * (1 - self.memory_reserve)

    def peak_bytes(self, which: str = "planned") -> list[int]:
        """Each pp rank's simulated peak memory per device."""
        return [r.peak_bytes for r in self.simulation_of(which).ranks]

    def fits(self, which: str = "planned") -> list[bool]:
        """Whether each pp rank's simulated peak fits :attr:`usable_bytes`."""
        return [p <= self.usable_bytes for p in self.peak_bytes(which)]

    def param_bytes_per_device(self, which: str = "planned") -> int:
        """Parameter bytes per device: max over pipeline ranks of the sum over its stages."""
        plans = [s.plan if which == "planned" else s.torchtitan for s in self.stages]
        b = [p.param_bytes_per_device for p in plans]  # type: ignore[union-attr]
        return max(sum(b[s] for s in ids) for ids in self.stage_ids_per_rank)

    @property
    def p2p_bytes_per_microbatch(self) -> int:
        """Σ over stage boundaries of the bytes one device sends forward per microbatch."""
        return sum(s.send_bytes for s in self.stages)

    @property
    def p2p_bytes_per_step(self) -> int:
        """Activations forward plus their gradients backward, all boundaries, all
        microbatches, per device of a stage: 2 · M · Σ send_bytes."""
        return 2 * self.n_microbatches * self.p2p_bytes_per_microbatch

    @property
    def planning_s(self) -> float:
        return sum(s.plan_wall_s + s.torchtitan_wall_s for s in self.stages)

    def write_trace(self, path: str | os.PathLike, which: str = "planned"):
        """The simulated step as a Chrome / Perfetto trace JSON."""
        return write_chrome_trace(self.simulation_of(which), path)

    def write_timeline(self, path: str | os.PathLike, which: str = "planned"):
        """The simulated step as a PNG timeline (one row per pp rank, memory below)."""
        from autopp.extras import require

        require("plot", for_what="the timeline PNG")
        return write_timeline_png(self.simulation_of(which), path)

    def __str__(self) -> str:
        return format_report(self)


__all__ = ["DryRunReport", "StageReport", "compact_modules", "dry_run", "placement_summary"]


def _plan_torchtitan(stage, inputs, sub_mesh, profile, index, *, first: bool, last: bool,
                     mixed_precision=None, n_microbatches: int = 1, tf32: bool = False,
                     keyword_inputs=None):
    """torchtitan's layout priced by the planner (activations re-optimised), cached on disk.

    As torchtitan runs it with TP: sequence parallel between blocks, so a stage sends its
    activation split on the sequence over tp ("batch+seq"), and loss parallel (the logits
    stay split on the vocabulary, "vocab") at the end; under PP its FSDP reduces gradients
    once per step, like autopp's planned stages (priced at 1/M per microbatch).
    """
    names = tuple(sub_mesh.mesh_dim_names)
    tp = sub_mesh["tp"].size()
    b_in = "batch" if first or tp == 1 else "batch+seq"
    b_out = ("vocab" if last else "batch+seq") if tp > 1 else "batch"
    request = StageRequest(
        module=stage, example_inputs=inputs, mesh=sub_mesh, profile=profile,
        param_placements=torchtitan_stage_placements(stage, names),
        input_placements=BOUNDARIES[b_in], output_placements=BOUNDARIES[b_out],
        mixed_precision=mixed_precision, microbatches_per_grad_reduce=n_microbatches,
        tf32=tf32, keyword_inputs=keyword_inputs or {})
    t0 = time.perf_counter()
    plan, hit = cached_plan(request.key(), lambda: plan_stage(request))
    dt = time.perf_counter() - t0
    logger.info("stage %d: torchtitan layout priced in %.1f s (%s)", index, dt,
                "cached" if hit else "solved")
    return plan, dt, hit


def dry_run(
    model_meta: nn.Module,
    *,
    pp: int,
    dp: int,
    tp: int,
    schedule: str = "1F1B",
    n_microbatches: int,
    global_batch: int,
    seq_len: int,
    options: PlannerOptions | None = None,
    split=None,
    compare: bool = False,
    activations: bool = True,
    trace: str | os.PathLike | None = None,
    timeline: str | os.PathLike | None = None,
    example_kwargs: Mapping[str, torch.Tensor] | None = None,
    **old_keywords: Any,
) -> DryRunReport:
    """Plan the pipeline of ``model_meta`` for a pp × dp × tp world on this machine alone.

    Without an initialised process group the fake one is set up for pp·dp·tp ranks (and torn
    down after). Plans with ``options`` exactly as a job would (default profile "H100": a dry
    run stands for a GPU job) and checks the fit against the same reserve; the loss is taken
    to be :func:`autopp.cross_entropy`. ``compare`` also prices torchtitan's FSDP+TP layout
    of every stage under the same cost model; ``activations`` lowers each stage to read its
    activation memory and F / I / W split; ``trace`` / ``timeline`` write the simulated step.

    Invariant: what it plans is what ``pipeline_autoparallel(..., plan=report.plan)`` runs,
    with the same ``example_kwargs``. Loose planner keywords are refused with the
    ``options=PlannerOptions(...)`` to write. Every argument in full: docs/api.md.
    """
    from autopp import adapters

    adapters.prepare(model_meta)  # e.g. a transformers model's attention (logged)
    refuse_loose("dry_run", old_keywords, {"global_batch_size": "global_batch"})
    if timeline is not None:  # before planning, not after it
        from autopp.extras import require

        require("plot", for_what="dry_run(timeline=...)")
    options = options if options is not None else PlannerOptions()
    if options.profile is None:
        options = dataclasses.replace(options, profile="H100")
    if options.loss_parallel and tp == 1:  # nothing to split the logits over
        options = dataclasses.replace(options, loss_parallel=None)
    world = pp * dp * tp
    created = False
    if not dist.is_initialized():
        init_fake_world(world)
        created = True
    elif dist.get_world_size() != world:
        raise ValueError(
            f"torch.distributed is initialised with {dist.get_world_size()} ranks, but "
            f"pp={pp} x dp={dp} x tp={tp} needs {world}"
        )
    t0 = time.perf_counter()
    try:
        # MoE dispatch, expert dtype; the collector off the imported heap while planning
        with tracing.settings(options.trace_settings()), frozen_heap():
            report = _dry_run(model_meta, pp=pp, dp=dp, tp=tp, schedule=schedule,
                              n_microbatches=n_microbatches, global_batch=global_batch,
                              seq_len=seq_len, options=options, split=split,
                              compare=compare, activations=activations,
                              example_kwargs=example_kwargs)
    finally:
        if created:
            dist.destroy_process_group()
    report = dataclasses.replace(report, wall_s=time.perf_counter() - t0)
    if trace is not None:
        logger.info("simulated step written to %s (Chrome trace)", report.write_trace(trace))
    if timeline is not None:
        logger.info("simulated step drawn in %s", report.write_timeline(timeline))
    return report


def _stage_estimate(meta, plan, sub_mesh, x, n_microbatches, *, activations, loss_s,
                    send, memo, gathering, overlap=True) -> tuple[StageFacts, StageCost]:
    """A stage's facts (from its lowered graphs, or by rule) and its simulator cost."""
    return stage_estimate(meta, plan, sub_mesh, x, n_microbatches,
                          mode="graphs" if activations else "rule", loss_s=loss_s,
                          send_bytes=send, memo=memo, gathering=gathering, overlap=overlap)


def _dry_run(model_meta, *, pp, dp, tp, schedule, n_microbatches, global_batch, seq_len,
             options: PlannerOptions, split, compare, activations,
             example_kwargs=None) -> DryRunReport:
    profile, mixed_precision = options.profile, options.mixed_precision
    memory_budget_bytes, memory_reserve = options.memory_budget_bytes, options.memory_reserve
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    mesh = build_world_mesh(pp=pp, dp=dp, tp=tp, device_type="cpu")
    sub_mesh = stage_sub_mesh(mesh)

    info, fqns_per_stage = split_for_schedule(
        model_meta, schedule=schedule, split=split, pp=pp, n_microbatches=n_microbatches,
        local_batch_size=global_batch // dp,
    )
    n_stages = len(fqns_per_stage)
    ids_per_rank = tuple(tuple(info.stage_ids_for_rank(r, pp, n_stages)) for r in range(pp))
    stage_ranks = stage_ranks_of(info, pp, n_stages)
    rank_of = dict(enumerate(stage_ranks))

    local = (torch.empty((global_batch // dp, seq_len), dtype=torch.long, device="meta"),)
    keyword = example_keyword_inputs(example_kwargs, local)
    pd = mixed_precision.param_dtype if mixed_precision is not None else None
    metas = [build_stage_module(model_meta, list(f), allow_tied=True) for f in fqns_per_stage]
    # a forward that reads its input (GPT-2's shapes) gets the model's inputs on every stage
    keyword = stage_keyword_inputs(metas, local, n_microbatches, keyword)
    metas, inputs = stage_meta_inputs(model_meta, fqns_per_stage, local[0], n_microbatches,
                                      dp, pd, metas, keyword)
    logger.info("dry run: %d stages on a %s sub-mesh, microbatch %s (dp-global), profile %s",
                n_stages, tuple(sub_mesh.shape), tuple(inputs[0][0].shape), profile)
    device = get_profile(profile)  # resolved once; the report names it as given

    tt_plans: list[tuple] = []
    budgets = []
    for s, (stage, x) in enumerate(zip(metas, inputs)):
        if compare:
            tt_plans.append(_plan_torchtitan(stage, x, sub_mesh, device, s, first=s == 0,
                                             last=s == n_stages - 1,
                                             mixed_precision=mixed_precision,
                                             n_microbatches=n_microbatches,
                                             tf32=options.tf32,
                                             keyword_inputs=microbatch_keyword_inputs(
                                                 keyword, n_microbatches, dp)))
        budget = memory_budget_bytes
        if compare and budget is None and options.parameter_budget_bytes is None:
            budget = tt_plans[s][0].param_bytes_per_device * (1 + 1e-9)
        budgets.append(budget)
    logits = last_stage_output(metas, inputs, mixed_precision, keyword)
    tt_kind = "batch+seq" if tp > 1 else "batch"  # torchtitan's boundaries (sequence parallel)
    memo: dict = {}  # lowered unit plans, shared by the stages (of one process)

    def send_of(s: int, bounds: Sequence[str]) -> tuple[tuple | None, int]:
        if s == n_stages - 1:
            return None, 0
        out_t = inputs[s + 1][0]
        shape = [out_t.shape[0] // dp, *out_t.shape[1:]]
        if bounds[s + 1] == "batch+seq":
            shape[1] //= tp
        return tuple(shape), boundary_bytes(out_t, dp, tp, bounds[s + 1])

    def cost_of(s: int, plan: Any, bounds: Sequence[str]) -> tuple:
        """Stage ``s``'s facts and costs, torchtitan's layout's cost, and the seconds."""
        t0 = time.perf_counter()
        facts, cost = _stage_estimate(metas[s], plan, sub_mesh, inputs[s], n_microbatches,
                                      activations=activations, loss_s=plan.loss_s,
                                      send=send_of(s, bounds)[1], memo=memo,
                                      gathering=WeightGathering.of_stage(
                                          plan, options.prefetch_blocks),
                                      overlap=options.overlap_collectives)
        tt_cost = None
        if compare:
            last = s == n_stages - 1
            tt_send = 0 if last else boundary_bytes(inputs[s + 1][0], dp, tp, tt_kind)
            _, tt_cost = _stage_estimate(metas[s], tt_plans[s][0], sub_mesh, inputs[s],
                                         n_microbatches, activations=activations,
                                         loss_s=tt_loss_s(s), send=tt_send, memo=memo,
                                         gathering=WeightGathering(),
                                         overlap=options.overlap_collectives)
        return facts, cost, tt_cost, time.perf_counter() - t0

    def tt_loss_s(s: int) -> float:
        if s != n_stages - 1:
            return 0.0
        return loss_time_s(logits, sub_mesh, device, "vocab" if tp > 1 else "batch")

    # lowering each stage's plan for its memory and F / I / W split: in the process that
    # planned it, right after (plan/parallel.py); where the plan came from the cache, on
    # forked processes where this one can fork
    planned = plan_whole_pipeline(PipelineRequest(
        model=model_meta, pp=pp, fqns_per_stage=fqns_per_stage, stage_ranks=stage_ranks,
        sub_mesh=sub_mesh, schedule=str(schedule), n_microbatches=n_microbatches,
        example_inputs=local, options=options, loss_fn=cross_entropy,
        budgets=budgets if compare and options.parameter_budget_bytes is None else None,
        # None: the options' budgets (by default the device memory, all categories)
        keyword_inputs=keyword or {}, after_stage=cost_of,
        stage_modules=tuple(metas)))  # built above, not again
    pplan, after, timings = planned.plan, planned.after, planned.timings
    reused_from = {s: c[0] for c in planned.classes for s in c[1:]}
    bounds = pplan.boundaries
    costed = [after[s] for s in range(n_stages)] if len(after) == n_stages else map_stages(
        lambda s: cost_of(s, pplan.stage_plans[s], bounds), n_stages)
    stages = []
    for s, x in enumerate(inputs):
        plan = pplan.stage_plans[s]
        timing = timings.get(s, StageTiming(cached=1))
        wall, n_solved = timing.seconds, timing.solved
        kind = bounds[s + 1]
        shape, send = send_of(s, bounds)
        facts, cost, tt_cost, costed_s = costed[s]
        logger.info("stage %d/%d (%s): %.3f ms per microbatch, %.2f GiB params/device, "
                    "planned in %.1f s (%d solved), costed in %.1f s", s, n_stages,
                    compact_modules(fqns_per_stage[s]), plan.step_time_s * 1e3,
                    plan.param_bytes_per_device / 2**30, wall, n_solved, costed_s)
        tt, tt_loss = (None, 0.0, False), 0.0
        if compare:
            tt, tt_loss = tt_plans[s], tt_loss_s(s)
        stages.append(StageReport(
            index=s, pp_rank=rank_of[s], modules=compact_modules(fqns_per_stage[s]),
            input_shapes=tuple(tuple(t.shape) for t in x if isinstance(t, torch.Tensor)),
            plan=plan, plan_wall_s=wall, cached=n_solved == 0, send_shape=shape,
            send_bytes=send, cost=cost, facts=facts, torchtitan=tt[0],
            torchtitan_wall_s=tt[1], torchtitan_cached=tt[2], torchtitan_cost=tt_cost,
            boundary_out=kind, loss_s=plan.loss_s, torchtitan_loss_s=tt_loss,
            reused_from=reused_from.get(s),
        ))
    shape3 = (pp, dp, tp)
    link = slowest_link(pp_links(device, shape3, stage_ranks), pp_link(device, shape3))
    sim_args = dict(pp=pp, n_microbatches=n_microbatches, stage_ranks=stage_ranks,
                    profile=device, mesh_shape=(pp, dp, tp))
    sim = simulate_stages(schedule, [s.cost for s in stages], **sim_args)
    tt_sim = simulate_stages(schedule, [s.torchtitan_cost for s in stages], **sim_args) \
        if compare else None
    ck_sim, working = None, ()
    if activations:
        ck_sim = simulate_stages(
            schedule, [full_checkpointing_cost(s.cost, s.facts) for s in stages], **sim_args)
        working = tuple(max(stages[s].facts.largest_unit_activation_bytes for s in ids)
                        for ids in ids_per_rank)
    notes = ()
    if compare:
        notes = (
            "torchtitan's parameters fixed to its FSDP (S(0) on dp) + TP placements (wq/wk/wv/"
            "wqkv/w1/w3 and the embedding and output projection S(0), wo/w2 S(1), norms R on "
            "tp); its activation placements are re-optimised by the same solver",
            "each stage is planned under " + (
                "the given parameter-memory budget" if memory_budget_bytes is not None else
                "the parameter memory torchtitan's layout uses for it"),
        )
    pplan = dataclasses.replace(pplan, estimates=pipeline_estimates(
        sim, [s.time_s for s in stages], ids_per_rank, n_microbatches, device, memory_reserve,
        pp * dp * tp))
    return DryRunReport(
        plan=pplan,
        pp=pp, dp=dp, tp=tp, schedule=str(schedule), n_microbatches=n_microbatches,
        global_batch=global_batch, seq_len=seq_len, profile=profile,
        memory_budget_bytes=memory_budget_bytes, stages=tuple(stages),
        stage_ids_per_rank=ids_per_rank, simulation=sim, link=link,
        device_memory_bytes=device.memory_bytes, memory_reserve=memory_reserve,
        compare=compare, compare_notes=notes,
        mixed_precision=None if mixed_precision is None else
        f"parameters computed in {pd}, gradients reduced in {mixed_precision.reduce_dtype}",
        torchtitan_simulation=tt_sim, checkpointed_simulation=ck_sim,
        checkpoint_working_bytes=working, distinct_plans=planned.distinct_plans,
    )
