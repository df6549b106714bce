"""``parallelize="auto"``, planning side: what every stage of a pipeline runs as.

A :class:`PipelineRequest` says what to plan; :func:`plan_whole_pipeline` answers with a
:class:`PipelineResult` (the :class:`~autopp.plan.value.PipelinePlan`, cached on disk whole
under the request's key, and each stage's planning time), in three steps: the placement of
parameters tied across stages, every stage boundary's placement and the last stage's logits'
by Alpa's objective (:func:`autopp.plan.boundaries.choose_boundaries`) on the stages'
planned times, then each stage under its budget
(:func:`~autopp.plan.local_stage.plan_local_stage`, cached on disk per stage).
:func:`planned_stages` reads a rank's stages back out of the plan.

Shared by :func:`autopp.plan_pipeline`, :func:`autopp.pipeline_autoparallel` and
:func:`autopp.dry_run.dry_run`; the planned stage's runtime is :mod:`autopp.lower.stage`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
from autopp.plan.local_stage import StageTiming, plan_local_stage
from autopp.plan.options import PlannerOptions, refuse_loose
from autopp.plan.parallel import map_stages
from autopp.plan.rank0 import plan_on_rank0
from autopp.plan.stage_classes import (
    IN_FLIGHT_RATIO,
    StageClass,
    class_key,
    class_request,
    group,
    name_map,
    renamed,
    unit_structure,
    with_windows,
)
from autopp.plan.stage_inputs import last_stage_output, stage_meta_inputs
from autopp.plan.value import (
    PipelinePlan,
    PlanOptions,
    describe_inputs,
    model_fingerprint,
    model_structure,
)
from autopp.profiles.devices import DeviceProfile
from autopp.sharding import InfeasiblePlanError, StageMemory, StagePlan, StageRequest
from autopp.sharding.plan import describe_keyword_inputs
from autopp.tracing.units import captures_reused

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


def collectives_ahead(options: Any) -> bool:
    """Whether planned stages issue their once-per-step collectives ahead, beside compute
    (``StageGraphs.collectives_ahead``): with ``overlap_collectives`` on and weights gathered
    once per step (not per block: :class:`~autopp.graph.weight_gathering.WeightGathering`,
    the one home of that choice; per block, each graph issues its own ahead)."""
    from autopp.graph.weight_gathering import WeightGathering

    return (bool(options.overlap_collectives)
            and not WeightGathering.from_options(options).per_block)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineRequest:
    """A split pipeline to plan whole (:func:`plan_whole_pipeline`): what its plan depends
    on, the device profile and each stage's memory spec resolved once, on construction;
    :meth:`key` is its plan cache key."""

    model: nn.Module
    """The whole model, on meta."""
    pp: int
    fqns_per_stage: tuple[tuple[str, ...], ...]
    """The split: each stage's module FQNs."""
    stage_ranks: tuple[int, ...]
    """Each stage's pp rank."""
    sub_mesh: DeviceMesh
    """A stage's ("dp", "tp") sub-mesh (all have its shape)."""
    schedule: str
    n_microbatches: int
    example_inputs: tuple[torch.Tensor, ...]
    """The model's inputs for one step on one dp rank."""
    options: Any
    """:class:`autopp.backends.PlannerOptions`."""
    loss_fn: Any
    """The pipeline's loss (whether it may run in parallel, :func:`loss_kinds`)."""
    budgets: tuple[float | None, ...] | None = None
    """Per-stage parameter-memory budgets (the dry run's comparisons); None: the options'
    (each stage's, before the fixed terms come off: ``memory[s].budget_bytes``)."""
    keyword_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Keyword inputs of the forward for one step on one dp rank (batch on dim 0), which
    every stage takes with each microbatch as graph inputs."""
    stage_modules: tuple[nn.Module, ...] | None = None
    """The stages on meta when the caller built them already; not in the key."""
    use_cache: bool = True
    """Read and write the whole plan in the on-disk cache; not in the key."""
    reuse_plans: str = field(default_factory=lambda: os.environ.get("AUTOPP_PLAN_REUSE", "auto"))
    """Plan each class of alike stages once (:mod:`autopp.plan.stage_classes`): "auto" with
    budget classes, "exact" only stages of equal in flight, "0" every stage alone (from
    ``AUTOPP_PLAN_REUSE``)."""
    after_stage: Callable[[int, StagePlan, tuple[str, ...]], Any] | None = None
    """``after_stage(s, plan, boundaries)``: run right after stage ``s`` is planned, in the
    process that planned it (the dry run costs each plan so); not run on a cached plan."""
    profile: DeviceProfile = field(init=False)
    """The options' profile, resolved ("measure": this machine's, by its own name)."""
    memory: tuple[StageMemory, ...] = field(init=False)
    """Each stage's memory spec, its budget before the fixed terms come off."""
    whole_memory: bool = field(init=False)
    """Whether the whole memory is counted (not parameter bytes alone)."""

    def __post_init__(self) -> None:
        from autopp.profiles import get_profile

        set_ = object.__setattr__
        o = self.options
        set_(self, "fqns_per_stage", tuple(tuple(f) for f in self.fqns_per_stage))
        set_(self, "stage_ranks", tuple(self.stage_ranks))
        set_(self, "schedule", str(self.schedule))
        set_(self, "example_inputs", tuple(self.example_inputs))
        set_(self, "keyword_inputs", dict(self.keyword_inputs or {}))
        set_(self, "profile", get_profile(o.profile or default_profile(self.sub_mesh.device_type)))
        set_(self, "whole_memory", self.budgets is None and o.parameter_budget_bytes is None)
        if self.budgets is None:
            budgets, memory = memory_budgets(o, self.profile, self.schedule, self.pp,
                                             self.n_microbatches, self.stage_ranks)
        else:  # explicit per-stage budgets: parameter bytes only
            set_(self, "budgets", tuple(self.budgets))
            budgets, memory = self.budgets, [StageMemory()] * len(self.fqns_per_stage)
        set_(self, "memory", tuple(dataclasses.replace(m, budget_bytes=b)
                                   for m, b in zip(memory, budgets, strict=True)))

    @property
    def record(self) -> PlanOptions:
        """The options as the plan records them."""
        return PlanOptions.of(self.options, self.profile.name)

    @property
    def last_kinds(self) -> tuple[str, ...]:
        return tuple(loss_kinds(self.sub_mesh, self.loss_fn, self.options.loss_parallel))

    def key(self) -> str:
        """The whole plan's cache key (:func:`~autopp.sharding.cache_key.pipeline_plan_key`)."""
        kw = describe_keyword_inputs(self.keyword_inputs)
        memory = [{k: v for k, v in dataclasses.asdict(m).items() if k != "budget_bytes"}
                  for m in self.memory]
        return pipeline_plan_key({
            "model": model_fingerprint(self.model), "forward": forward_code(self.model),
            "pp": self.pp, "split": self.fqns_per_stage, "stage_ranks": list(self.stage_ranks),
            "sub_mesh": [list(self.sub_mesh.shape), list(self.sub_mesh.mesh_dim_names)],
            "schedule": self.schedule, "n_microbatches": self.n_microbatches,
            "inputs": [[list(x.shape), str(x.dtype)] for x in self.example_inputs],
            **({"keyword_inputs": [[k, list(s), d] for k, s, d in kw]} if kw else {}),
            "options": dataclasses.asdict(self.record), "recompute": self.options.recompute,
            "last_kinds": list(self.last_kinds),
            "budgets": [m.budget_bytes for m in self.memory],
            "memory": memory if self.budgets is None else None,
            "reuse_plans": self.reuse_plans,
        })


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """What :func:`plan_whole_pipeline` answers."""

    plan: PipelinePlan
    cached: bool
    """Read whole from the on-disk cache (then nothing below was planned)."""
    timings: Mapping[int, StageTiming] = field(default_factory=dict)
    """By stage: the seconds spent planning it, plans solved and read from the cache."""
    after: Mapping[int, Any] = field(default_factory=dict)
    """By stage: ``after_stage``'s results."""
    classes: tuple[tuple[int, ...], ...] = ()
    """The classes of alike stages planned once each (the first member planned, the others
    reusing its plan: :mod:`autopp.plan.stage_classes`); empty for a cached plan."""

    @property
    def distinct_plans(self) -> int:
        """Stage plans made under a budget (one per class); 0 for a cached plan."""
        return len(self.classes)


class _Planning:
    """One :class:`PipelineRequest` being planned: the stages on meta with their inputs,
    each stage planned under given boundaries (:meth:`plan`, its time added to
    :attr:`timings`), and the steps :func:`plan_whole_pipeline` takes in order."""

    def __init__(self, r: PipelineRequest) -> None:
        self.r = r
        self.dp, self.tp = r.sub_mesh["dp"].size(), r.sub_mesh["tp"].size()
        self.mp = r.options.mixed_precision
        self.keyword = microbatch_keyword_inputs(r.keyword_inputs, r.n_microbatches, self.dp)
        self.metas, self.inputs = stage_meta_inputs(
            r.model, r.fqns_per_stage, r.example_inputs[0], r.n_microbatches, self.dp,
            r.record.compute_dtype, r.stage_modules, self.keyword)
        self.n = len(self.metas)
        self.logits = last_stage_output(self.metas, self.inputs, self.mp, self.keyword)
        self.timings: dict[int, StageTiming] = {}
        self.fixed: list[dict[str, tuple[str, ...]]] = [{} for _ in self.metas]
        self.budgets = self.budgets_at(None)
        self.units: list[Any] = []
        self.stage_classes: tuple[tuple[int, ...], ...] = ()

    def budgets_at(self, bounds: Sequence[str] | None) -> list[float | None]:
        """The budgets less what the ILP's row does not count, with the receive buffers at
        ``bounds`` (None: every boundary at its largest kind); as given with parameter
        bytes alone counted."""
        r = self.r
        if not r.whole_memory:
            return [m.budget_bytes for m in r.memory]
        fixed = fixed_stage_bytes(self.metas, self.inputs, n_microbatches=r.n_microbatches,
                                  dp=self.dp, tp=self.tp, bounds=bounds)
        fixed[-1] += loss_kept_bytes(self.logits, self.dp, self.tp, r.last_kinds,
                                     r.memory[-1].activation_factor)
        return budgets_less_fixed(
            [m.budget_bytes for m in r.memory], fixed,
            communicator_bytes(r.profile.communicator_bytes, (r.pp, self.dp, self.tp)),
            r.stage_ranks)

    def request(self, s: int, k_in: str = "batch", k_out: str = "batch",
                budget: float | None = None,
                windows: tuple[float, float] = (0.0, 0.0)) -> StageRequest:
        """Stage ``s``'s request between boundaries ``k_in`` and ``k_out``."""
        r = self.r
        return StageRequest(
            module=self.metas[s], example_inputs=self.inputs[s], mesh=r.sub_mesh,
            profile=r.profile, input_placements=BOUNDARIES[k_in],
            output_placements=BOUNDARIES[k_out], param_placements=self.fixed[s],
            memory=dataclasses.replace(r.memory[s], budget_bytes=budget),
            mixed_precision=self.mp, tf32=r.options.tf32, keyword_inputs=self.keyword,
            microbatches_per_grad_reduce=r.n_microbatches, comm_windows_s=windows,
            optimality_gap=r.options.optimality_gap)

    def plan(self, s: int, k_in: str, k_out: str, budget: float | None = None) -> StagePlan:
        """Stage ``s`` planned between ``k_in`` and ``k_out``, its time added up."""
        plan, timing = self.gathered_as_fits(self.request(s, k_in, k_out, budget), s)
        self.timings[s] = self.timings.get(s, StageTiming()) + timing
        return plan

    def loss_s(self, s: int, k_out: str) -> float:
        if s != self.n - 1:
            return 0.0
        return loss_time_s(self.logits, self.r.sub_mesh, self.r.profile, k_out)

    def tied(self) -> None:
        """Per stage, the placement every copy of a parameter tied across stages must have
        (their gradients are summed shard by shard, :mod:`autopp.tied`): the one chosen for
        it on the stage holding its first FQN, with batch boundaries, under the budgets
        with every boundary at its largest kind (a bound whatever is chosen)."""
        from autopp.tied import find_tied

        for t in find_tied(self.r.model, self.r.fqns_per_stage):
            home = next(s for s, fqn in t.stage_fqns if fqn == t.name)
            ask = self.request(home, budget=self.budgets[home]).replace(param_placements={})
            plan, _ = plan_local_stage(ask, stage_index=home)
            pl = next(p.placements for p in plan.params if p.fqn == t.name)
            for s, fqn in t.stage_fqns:
                self.fixed[s][fqn] = tuple(pl)

    def boundaries(self) -> tuple[list[str], dict[tuple[int, str, str], StagePlan]]:
        """Every stage boundary's placement and the last stage's logits' (``len + 1``
        entries), by Alpa's objective (:func:`choose_boundaries`) on the stages' times,
        and the plans compared: each stage's time-optimal plan where the whole memory is
        counted (the chosen ones are planned under budget after), else under the
        parameter budget. Every rank computes the same boundaries."""
        r, n = self.r, self.n
        kinds = (boundary_kinds(r.sub_mesh) if r.options.boundary == "auto"
                 else (r.options.boundary,))
        if any(k not in BOUNDARIES or k == "vocab" for k in kinds):
            raise ValueError(f"boundary must be 'auto', 'batch' or 'batch+seq', got "
                             f"{r.options.boundary!r}")
        last_kinds, ranks = r.last_kinds, list(r.stage_ranks)
        mesh_shape = (r.pp, self.dp, self.tp)
        compared: dict[tuple[int, str, str], StagePlan] = {}

        def budget(s: int) -> float | None:
            return None if r.whole_memory else self.budgets[s]

        def stage_time(s: int, k_in: str, k_out: str) -> float:
            try:  # e.g. a sequence tp does not divide: not a candidate
                p = compared[s, k_in, k_out] = self.plan(s, k_in, k_out, budget(s))
            except InfeasiblePlanError:
                return math.inf
            return p.step_time_s + self.loss_s(s, k_out)

        def send_time(s: int, kind: str) -> float:  # forward and back, between ranks joined
            nbytes = boundary_bytes(self.inputs[s + 1][0], self.dp, self.tp, kind)
            if ranks[s] == ranks[s + 1]:
                return 0.0
            return (transfer_s(pp_link(r.profile, mesh_shape, ranks[s], ranks[s + 1]), nbytes)
                    + transfer_s(pp_link(r.profile, mesh_shape, ranks[s + 1], ranks[s]), nbytes))

        if len(kinds) > 1 or len(last_kinds) > 1:
            bounds = choose_boundaries(n, kinds, stage_time, send_time, last_kinds,
                                       n_microbatches=r.n_microbatches, rank_of=ranks)
        else:
            bounds = [kinds[0]] * n + [last_kinds[0]]
            bounds[0] = "batch"
        if math.isinf(sum(stage_time(s, bounds[s], bounds[s + 1]) for s in range(n))):
            for s in range(n):  # no feasible choice: raise the first stage's planner error
                self.plan(s, bounds[s], bounds[s + 1], budget(s))
        return bounds, compared

    def windows(self, bounds: Sequence[str], compared: Mapping[tuple[int, str, str], StagePlan]
                ) -> list[tuple[float, float]]:
        """Where the schedule runs the stages' once-per-step collectives ahead, beside
        compute, and the whole memory is counted: the seconds of each step they may take
        (:func:`schedule_windows` over the unbudgeted plans' times less those collectives,
        the last stage's with its loss); else zero (every collective priced in full)."""
        r, n = self.r, self.n
        if not (collectives_ahead(r.options) and r.whole_memory):
            return [(0.0, 0.0)] * n
        fast = [compared.get((s, bounds[s], bounds[s + 1])) or
                self.plan(s, bounds[s], bounds[s + 1]) for s in range(n)]
        mesh_shape = (r.pp, self.dp, self.tp)
        windows = schedule_windows(
            r.schedule, [p.step_time_s - sum(p.once_per_step_s()) + self.loss_s(s, bounds[s + 1])
                         for s, p in enumerate(fast)],
            pp=r.pp, n_microbatches=r.n_microbatches, stage_ranks=list(r.stage_ranks),
            send_bytes=self.send_bytes(bounds), link=pp_link(r.profile, mesh_shape),
            links=pp_links(r.profile, mesh_shape, list(r.stage_ranks)))
        logger.info("once-per-step collectives' windows a step (gathers, reductions): %s",
                    ", ".join(f"stage {s} {w[0] * 1e3:.3g}/{w[1] * 1e3:.3g} ms"
                              for s, w in enumerate(windows)))
        return windows

    def send_bytes(self, bounds: Sequence[str]) -> list[int]:
        return [boundary_bytes(self.inputs[s + 1][0], self.dp, self.tp, bounds[s + 1])
                if s + 1 < self.n else 0 for s in range(self.n)]

    def gathered_as_fits(self, request: StageRequest, s: int
                         ) -> tuple[StagePlan, StageTiming]:
        """Stage ``s``'s plan for ``request``; under ``weight_gathering="auto"`` also block by
        block where once per step does not fit or must recompute to fit, the faster kept
        (per block holds two blocks' gathered weights and reduced gradients, and gathers
        every microbatch: it pays off only where memory is short)."""
        if self.r.options.weight_gathering != "auto":
            return plan_local_stage(request, stage_index=s)
        try:
            once, timing = plan_local_stage(request, stage_index=s)
        except InfeasiblePlanError:
            once, timing = None, StageTiming()
        if once is not None and (once.recompute or "none") == "none":
            return once, timing
        per_block = request.replace(weight_gathering="per_block",
                                    prefetch_blocks=self.r.options.prefetch_blocks)
        try:
            block, more = plan_local_stage(per_block, stage_index=s)
        except InfeasiblePlanError:
            if once is None:
                raise
            return once, timing
        if once is None or block.step_time_s < once.step_time_s:
            why = ("weights gathered block by block: once per step does not fit" if once is None
                   else f"weights gathered block by block: {block.step_time_s * 1e3:.3g} ms "
                   f"a microbatch against {once.step_time_s * 1e3:.3g} ms once per step, "
                   f"which must recompute ({once.recompute}) to fit")
            chosen = block
        else:
            why = (f"weights gathered once per step: {once.step_time_s * 1e3:.3g} ms a "
                   f"microbatch against {block.step_time_s * 1e3:.3g} ms block by block")
            chosen = once
        logger.info("stage %d: %s", s, why)
        return dataclasses.replace(chosen, notes=tuple(chosen.notes) + (why,)), timing + more

    def classes(self, requests: Sequence[StageRequest], free: Sequence[bool]
                ) -> list[StageClass]:
        """The stages' classes (:mod:`autopp.plan.stage_classes`): stages of alike units,
        boundaries and budget class share one plan (``free[s]``: stage ``s``'s time-optimal
        plan fits its budget); each stage alone with ``reuse_plans`` off."""
        from autopp.tracing.precision import check_policy
        from autopp.tracing.units import stage_units

        mode = self.r.reuse_plans
        if mode not in ("auto", "exact", "0"):
            raise ValueError(f"AUTOPP_PLAN_REUSE={mode!r}: 'auto', 'exact' or '0'")
        if mode == "0":
            return group([None] * len(requests), requests)
        self.units = []
        keys = []
        for s, q in enumerate(requests):
            units = (stage_units(q.module, q.example_inputs[0], q.keyword_inputs,
                                 param_dtype=check_policy(q.mixed_precision, q.module))
                     if q.reuse_blocks or q.keyword_inputs else None)
            self.units.append(units)
            keys.append(class_key(q, unit_structure(units), free[s],
                                  IN_FLIGHT_RATIO if mode == "auto" else None))
        return group(keys, requests)

    def solve(self) -> tuple[PipelinePlan, dict[int, Any]]:
        """The whole plan (tied placements, boundaries, each class of alike stages under its
        budget once, on worker processes where this one can fork:
        :mod:`autopp.plan.parallel`) and what ``after_stage`` answered, by stage."""
        r, n = self.r, self.n
        self.tied()
        bounds, compared = self.boundaries()
        windows = self.windows(bounds, compared)
        budgets = self.budgets_at(bounds)
        after = r.after_stage
        requests = [self.request(s, bounds[s], bounds[s + 1], budgets[s], windows[s])
                    for s in range(n)]
        # where the time-optimal plan compared for the boundaries fits, it is the plan
        fast = [compared.get((s, bounds[s], bounds[s + 1])) if r.whole_memory else None
                for s in range(n)]
        free = [p is not None and budgets[s] is not None and p.memory_bytes < budgets[s] - 1
                and (p.recompute or "none") == "none"
                and p.weight_gathering == requests[s].memory.weight_gathering
                for s, p in enumerate(fast)]
        classes = self.classes(requests, free)
        self.stage_classes = tuple(c.stages for c in classes)

        def planned(k: int) -> list[tuple[int, StagePlan, StageTiming, Any]]:
            c = classes[k]
            rep = c.stages[0]
            p, timing = self.gathered_as_fits(class_request(requests[rep], c), rep)
            out = []
            for s in c.stages:
                ps, ts = p, timing
                if s != rep:
                    ps = renamed(p, *name_map(self.units[rep], self.units[s]),
                                 f"the plan of stage {rep}, reused (alike units and "
                                 f"boundaries; planned for {c.activation_factor} microbatches "
                                 f"in flight under {c.budget_bytes} bytes a device)")
                    ts = StageTiming(reused=1)
                ps = with_windows(ps, requests[s].comm_windows_s, r.n_microbatches)
                if s == n - 1:  # the last stage's plan says how its loss runs
                    ps = dataclasses.replace(ps, loss=describe_loss(bounds[-1]),
                                             loss_s=self.loss_s(s, bounds[-1]))
                out.append((s, ps, ts, None if after is None else after(s, ps, tuple(bounds))))
            return out

        if len(classes) < n:
            logger.info("%d stages in %d classes of alike stages, each planned once: %s", n,
                        len(classes), ", ".join("+".join(map(str, c.stages)) for c in classes))
        by_class = map_stages(planned, len(classes), progress=lambda k, m, t: logger.info(
            "class %d/%d planned under its budget: %.1f s so far, %d to go", k, m, t, m - k))
        done = [None] * n
        for rows in by_class:
            for s, p, timing, a in rows:
                done[s] = (p, timing, a)
        for s, (_, timing, _) in enumerate(done):
            self.timings[s] = self.timings.get(s, StageTiming()) + timing
        stage_plans = tuple(p for p, _, _ in done)
        return PipelinePlan(
            model=model_fingerprint(r.model), model_structure=model_structure(r.model),
            pp=r.pp, dp=self.dp, tp=self.tp, schedule=r.schedule,
            n_microbatches=r.n_microbatches,
            input_shapes=tuple(tuple(int(d) for d in x.shape) for x in r.example_inputs),
            input_dtypes=tuple(str(x.dtype) for x in r.example_inputs),
            fqns_per_stage=r.fqns_per_stage, stage_ranks=r.stage_ranks,
            stage_plans=stage_plans, boundaries=tuple(bounds),
            recompute=tuple(getattr(p, "recompute", "none") or "none" for p in stage_plans),
            tied_placements=tuple(tuple(sorted(d.items())) for d in self.fixed),
            options=r.record, stage_inputs=tuple(describe_inputs(x) for x in self.inputs),
            send_bytes=tuple(self.send_bytes(bounds)),
            keyword_inputs=describe_keyword_inputs(r.keyword_inputs),
        ), ({} if after is None else {s: a for s, (_, _, a) in enumerate(done)})


def plan_whole_pipeline(request: PipelineRequest) -> PipelineResult:
    """Plan every stage of a split pipeline into one :class:`~autopp.plan.value.PipelinePlan`
    (without estimates): tied parameters' placements, then boundaries and loss placement by
    Alpa's objective (:func:`choose_boundaries`), then each stage under its budget.

    The plan depends on the request alone (and the planning code, which the key hashes):
    with ``request.use_cache``, it is read and written whole under ``request.key()``.
    """
    r = request
    result: list[PipelineResult] = []

    def solve() -> PipelinePlan:
        # MoE dispatch, expert dtype; the collector off the imported heap while planning;
        # each stage captured once for all the plans tried of it
        with tracing.settings(r.options.trace_settings()), frozen_heap(), captures_reused():
            planning = _Planning(r)
            plan, after = planning.solve()
        result.append(PipelineResult(plan, False, planning.timings, after,
                                     planning.stage_classes))
        return plan

    if not r.use_cache:
        plan, hit = solve(), False
    else:
        key = r.key()
        t0 = time.perf_counter()
        plan, hit = cached_pipeline_plan(key, solve)
        plan = dataclasses.replace(plan, cache_entries=(key, *(
            p.cache_entry for p in plan.stage_plans if p.cache_entry)))
        logger.info("pipeline plan %s: %d stages in %.1f s (%s)", key[9:21],
                    len(r.fqns_per_stage), time.perf_counter() - t0,
                    "cached" if hit else "planned")
    if r.options.strict:  # planned or cached: a fallback in either is refused
        plan.check_strict()
    if hit or not result:
        return PipelineResult(plan, hit)
    return dataclasses.replace(result[0], plan=plan)


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

    The step's inputs are ``example_inputs`` (one dp rank's, shapes and dtypes only) or
    ``global_batch`` and ``seq_len`` for int64 token ids; ``loss_fn`` (default
    :func:`autopp.cross_entropy`) decides whether the loss may run in parallel over tp.
    Without ``mesh`` one is built, on the fake process group when none is initialised, so
    this works on one machine with no devices. ``example_kwargs`` are planned as graph inputs
    of every stage and recorded in the plan, so a job running it must pass the same.

    In a job (a real process group), call it on every rank: rank 0 plans, the others
    receive its plan. Plans are cached on disk (:mod:`autopp.plan.cache`). Every argument
    in full: docs/api.md.
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
        plan, _ = plan_on_rank0(lambda: plan_whole_pipeline(PipelineRequest(
            model=model, pp=pp, fqns_per_stage=fqns,
            stage_ranks=stage_ranks_of(info, pp, len(fqns)), sub_mesh=stage_sub_mesh(mesh),
            schedule=str(schedule), n_microbatches=n_microbatches,
            example_inputs=example_inputs, options=options,
            loss_fn=loss_fn if loss_fn is not None else cross_entropy,
            keyword_inputs=keyword or {}, stage_modules=tuple(metas))))
    finally:
        if created:
            dist.destroy_process_group()
    return plan
