"""A whole pipeline's plan as one value, and the one function that makes it.

:class:`PipelinePlan` holds everything a planned pipeline runs with: the model's structural
fingerprint, the mesh, schedule and microbatches, the split and stage placement, every
stage's :class:`~autopp.sharding.StagePlan`, boundary, loss and tied placements, the
recomputation per stage, and (from a dry run) the estimates. It is frozen, equal after a JSON
round trip, and can be saved, loaded, printed (:meth:`PipelinePlan.describe`) and diffed;
``pipeline_autoparallel(..., plan="plan.json")`` runs one without planning.

Invariant: :func:`plan_pipeline` is the only way plans are made: the dry run calls its core
(:func:`autopp.plan.make.plan_whole_pipeline`) and the planner backend calls it at
``prepare``, so what runs is what a dry run plans. In a job, rank 0 plans (or reads the
cache) and broadcasts the JSON (:func:`plan_on_rank0`). Imports only the standard library
and torch, so ``import autopp`` stays light."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopp.format import dataclass_json

if TYPE_CHECKING:

    from autopp.plan.options import PlannerOptions
    from autopp.sharding import StagePlan

#: Version of the JSON layout written by :meth:`PipelinePlan.to_json`. 2: each stage's
#: inputs and send bytes are part of the plan (format 1 plans are refused: re-plan).
FORMAT = 2

#: One input of a stage for one dp-global microbatch: (name, shape, dtype), e.g.
#: ``("args[0]", (8, 2048, 4096), "torch.float32")``.
StageInput = tuple[str, tuple[int, ...], str]


def describe_inputs(inputs: Sequence[Any]) -> tuple[StageInput, ...]:
    """A stage's (meta) example inputs as :data:`StageInput` values."""
    return tuple((f"args[{i}]", tuple(int(d) for d in t.shape), str(t.dtype))
                 for i, t in enumerate(inputs) if isinstance(t, torch.Tensor))


def meta_tensors(inputs: Sequence[StageInput]) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the shapes and dtypes ``inputs`` record."""
    return tuple(torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device="meta")
                 for _, shape, dtype in inputs)


#: One parameter or buffer of a model as a plan records it: (kind, FQN, shape, dtype), kind
#: "param" or "buffer"; ("class", qualified name, (), "") first.
ModelEntry = tuple[str, str, tuple[int, ...], str]


def model_structure(model: nn.Module) -> tuple[ModelEntry, ...]:
    """What a plan records of its model, to say how another model differs from it: the
    class, then every parameter and buffer (tied copies under their first name)."""
    out: list[ModelEntry] = [("class", f"{type(model).__module__}.{type(model).__qualname__}",
                              (), "")]
    out += [("param", n, tuple(int(d) for d in p.shape), str(p.dtype))
            for n, p in model.named_parameters()]
    out += [("buffer", n, tuple(int(d) for d in b.shape), str(b.dtype))
            for n, b in model.named_buffers()]
    return tuple(out)


def _blocks_holding(names: Sequence[str]) -> str:
    """The blocks (``layers.4``: up to the first numeric part) or else the modules holding
    parameter or buffer ``names``, compacted (``layers.4-5``)."""
    from autopp.format import compact_modules

    def block(n: str) -> str:
        parts = n.split(".")
        i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        return ".".join(parts[:i + 1]) if i is not None else (n.rpartition(".")[0] or n)

    return compact_modules(sorted({block(n) for n in names}))


def structure_difference(planned: Sequence[ModelEntry], model: nn.Module) -> str | None:
    """The first way ``model`` differs from the model ``planned`` describes, in words
    (None: no difference in what :func:`model_structure` records)."""
    theirs = model_structure(model)
    if planned[0] != theirs[0]:
        return f"model class: the plan's is {planned[0][1]}, this one {theirs[0][1]}"
    for kind in ("param", "buffer"):
        a = {e[1]: e for e in planned if e[0] == kind}
        b = {e[1]: e for e in theirs if e[0] == kind}
        word = "parameters" if kind == "param" else "buffers"
        only_a = [n for n in a if n not in b]
        only_b = [n for n in b if n not in a]
        if only_a or only_b:
            parts = [f"{word}: the plan's model has {len(a)}, this one {len(b)}"]
            if only_a:
                parts.append(f"only the plan's has {_blocks_holding(only_a)}")
            if only_b:
                parts.append(f"only this one has {_blocks_holding(only_b)}")
            return "; ".join(parts)
        for n, (_, _, shape, dtype) in a.items():
            _, _, shape2, dtype2 = b[n]
            if (shape, dtype) != (shape2, dtype2):
                return (f"{kind} {n}: the plan has {list(shape)} {dtype.split('.')[-1]}, "
                        f"this model {list(shape2)} {dtype2.split('.')[-1]}")
    return None


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's structure: its class, module names and types, parameter and
    buffer names, shapes and dtypes, and which parameters are tied (meta is fine). Two
    builds of one config have the same fingerprint; another depth, width or dtype does not.
    The forward's code is not part of it."""
    first: dict[int, str] = {}
    desc = {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "modules": [[n, type(m).__qualname__] for n, m in model.named_modules()],
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad, first.setdefault(id(p), n)]
                   for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """The planner options a plan was made with (the planning fields of
    :class:`autopp.backends.PlannerOptions`, as JSON values)."""

    profile: str
    """The device profile of the cost model (resolved: never None)."""
    memory_budget_bytes: float | None = None
    """The budget asked for (None: the device's memory less ``memory_reserve``)."""
    memory_reserve: float = 0.1
    parameter_budget_bytes: float | None = None
    """The parameter-only budget asked for instead (None: not used)."""
    recompute: str = "auto"
    """The recomputation asked for; what each stage got is ``PipelinePlan.recompute``."""
    boundary: str = "auto"
    loss_parallel: bool | None = None
    param_dtype: str | None = None
    """Mixed precision: the policy's ``param_dtype`` (e.g. "torch.bfloat16"); None: off."""
    reduce_dtype: str | None = None
    """Mixed precision: the policy's ``reduce_dtype``."""
    token_dispatch: str = "auto"
    """MoE token dispatch (``PlannerOptions.token_dispatch``)."""
    expert_dims: str = "auto"
    """The stage-mesh dims MoE routed experts are split over (``PlannerOptions.expert_dims``)."""
    expert_compute_dtype: str = "bfloat16"
    """MoE routed experts' compute dtype (``PlannerOptions.expert_compute_dtype``)."""
    expert_imbalance: str = "1"
    """MoE routing's busiest device over the mean (``PlannerOptions.expert_imbalance``)."""
    tf32: bool = False
    """fp32 matmuls priced at the TF32 rate (``PlannerOptions.tf32``)."""
    weight_gathering: str = "once_per_step"
    """How the stages hold dp-sharded weights, as planned (``PlannerOptions.weight_gathering``)."""
    prefetch_blocks: int = 1
    optimality_gap: float | None = None
    """How close to proven-best each budgeted stage plan was solved
    (``PlannerOptions.optimality_gap``; None: the planner's default)."""

    @classmethod
    def of(cls, options: PlannerOptions, profile: str) -> PlanOptions:
        mp = options.mixed_precision
        return cls(profile=profile, memory_budget_bytes=options.memory_budget_bytes,
                   memory_reserve=options.memory_reserve,
                   parameter_budget_bytes=options.parameter_budget_bytes,
                   recompute=options.recompute,
                   boundary=options.boundary, loss_parallel=options.loss_parallel,
                   param_dtype=None if mp is None or mp.param_dtype is None else str(mp.param_dtype),
                   reduce_dtype=None if mp is None or mp.reduce_dtype is None
                   else str(mp.reduce_dtype), tf32=options.tf32,
                   weight_gathering=options.weight_gathering,
                   prefetch_blocks=options.prefetch_blocks,
                   optimality_gap=options.optimality_gap, **options.trace_settings())

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype of the activations the stages exchange (None: the parameters')."""
        return None if self.param_dtype is None else getattr(torch, self.param_dtype.split(".")[-1])

    def conflicts(self, options: PlannerOptions) -> list[str]:
        """Planning options set on ``options`` (not left at their defaults) that differ
        from these: a saved plan cannot honour them."""
        from autopp.plan.options import PlannerOptions

        default = PlannerOptions()
        given = PlanOptions.of(options, options.profile or self.profile)
        out = []
        for f in ("profile", "memory_budget_bytes", "memory_reserve",
                  "parameter_budget_bytes", "boundary", "loss_parallel", "token_dispatch",
                  "expert_dims", "expert_compute_dtype", "tf32", "weight_gathering",
                  "prefetch_blocks", "optimality_gap"):
            if getattr(options, f) != getattr(default, f) and getattr(given, f) != getattr(self, f):
                out.append(f"{f}: the plan has {getattr(self, f)!r}, the options "
                           f"{getattr(given, f)!r}")
        if options.mixed_precision is not None and (given.param_dtype, given.reduce_dtype) != (
                self.param_dtype, self.reduce_dtype):
            out.append(f"mixed_precision: the plan has param/reduce dtypes {self.param_dtype}/"
                       f"{self.reduce_dtype}, the options {given.param_dtype}/{given.reduce_dtype}")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineEstimates:
    """What the schedule simulator estimates for a plan (:func:`autopp.dry_run.dry_run`)."""

    step_time_s: float
    """The simulated step time of the plan's schedule."""
    bubble_fraction: float
    """Idle share of all pp ranks' time over the simulated step."""
    alpa_time_s: float
    """Alpa's closed formula, for comparison: Σ_s t_s + (M − 1) · slowest rank's Σ t_s."""
    stage_time_s: tuple[float, ...]
    """Per stage: one microbatch's forward + backward on one device (the loss included)."""
    peak_bytes: tuple[int, ...]
    """Per pp rank: the simulated peak memory per device."""
    memory_at_peak: tuple[tuple[tuple[str, int], ...], ...]
    """Per pp rank: (category, bytes) at its peak: parameters, gradients, optimizer,
    gathered_parameters, activations."""
    usable_bytes: float
    """The device memory minus the reserve: what each peak must fit."""

    @property
    def fits(self) -> tuple[bool, ...]:
        return tuple(p <= self.usable_bytes for p in self.peak_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePlan:
    """A whole pipeline's plan: what :func:`autopp.pipeline_autoparallel` runs with
    ``parallelize="auto"``, or with ``plan=`` without planning (see the module docstring)."""

    model: str
    """:func:`model_fingerprint` of the model it was made for."""
    pp: int
    dp: int
    tp: int
    schedule: str
    """A torch schedule name, or the CSV schedule's path."""
    n_microbatches: int
    input_shapes: tuple[tuple[int, ...], ...]
    """The model's inputs for one step on one dp rank (``example_inputs``)."""
    input_dtypes: tuple[str, ...]
    fqns_per_stage: tuple[tuple[str, ...], ...]
    """The split: module FQNs of each stage."""
    stage_ranks: tuple[int, ...]
    """The pp rank holding each stage."""
    stage_plans: tuple[StagePlan, ...]
    """Each stage's sharding plan over its dp × tp sub-mesh."""
    boundaries: tuple[str, ...]
    """Placement into stage ``s`` (``boundaries[s]``) and out of it (``boundaries[s + 1]``):
    "batch" or "batch+seq" (a key of :data:`autopp.plan.boundaries.BOUNDARIES`); the last entry
    is the loss placement ("vocab": loss parallel)."""
    recompute: tuple[str, ...]
    """Per stage: the activation recomputation its backward pieces run ("none",
    "selective", "full")."""
    tied_placements: tuple[tuple[tuple[str, tuple[str, ...]], ...], ...]
    """Per stage: (stage FQN, placement per sub-mesh dim) fixed for parameters tied across
    stages (:func:`autopp.plan.make.tied_placements`)."""
    options: PlanOptions
    """The planner options it was made with."""
    stage_inputs: tuple[tuple[StageInput, ...], ...]
    """Per stage: its inputs for one dp-global microbatch (name, shape, dtype), as planned;
    the runtime lowers each stage for these, so no rank runs the model to find them."""
    send_bytes: tuple[int, ...]
    """Per stage: bytes one device sends to the next stage per microbatch in the boundary's
    placement (0 for the last stage); its gradient comes back the same size."""
    estimates: PipelineEstimates | None = None
    """Simulated step time, bubble and memory (from a dry run); None when not estimated."""
    model_structure: tuple[ModelEntry, ...] = ()
    """:func:`model_structure` of the model it was made for: how a mismatching model
    differs is said from it (empty in plans saved before it was recorded)."""
    keyword_inputs: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    """The keyword inputs of the model's forward for one step on one dp rank (name, shape,
    dtype; e.g. a padding ``attention_mask``), which every stage takes with each microbatch
    (each stage plan records its microbatch's, :attr:`StagePlan.keyword_inputs`)."""
    cache_entries: tuple[str, ...] = ()
    """The on-disk plan cache entries (:mod:`autopp.plan.cache` keys) this plan was made
    from or stored under: the whole plan's and its stages'. A plan that fails to apply has
    them evicted (:func:`autopp.plan.cache.evict`). Empty for a plan made uncached."""
    format: int = FORMAT

    # ---- reading it -------------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.fqns_per_stage)

    @property
    def loss_placement(self) -> str:
        """"vocab" (loss parallel: logits stay split on the vocabulary over tp) or "batch"."""
        return self.boundaries[-1]

    def stage_example_inputs(self, s: int) -> tuple[torch.Tensor, ...]:
        """Stage ``s``'s inputs for one dp-global microbatch, as meta tensors."""
        return meta_tensors(self.stage_inputs[s])

    def stage_ids_for_rank(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == pp_rank)

    # ---- JSON -----------------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        """The plan as JSON (compact by default, as :meth:`StagePlan.to_json`)."""
        return dataclass_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        from autopp.sharding import StagePlan

        d = json.loads(text)
        if d.get("format") != FORMAT:
            why = (" (format 1 did not record each stage's inputs, which the runtime now "
                   "reads from the plan)" if d.get("format") == 1 else "")
            raise ValueError(f"pipeline plan format {d.get('format')!r} is not {FORMAT}{why}: "
                             "plan again with this version of autopp (autopp.plan_pipeline, "
                             "a dry run's report.plan.save(path), or pipeline_autoparallel "
                             "without plan=)")
        out = {k: _tuples(v) for k, v in d.items()}
        out["stage_plans"] = tuple(StagePlan.from_json(json.dumps(p)) for p in d["stage_plans"])
        out["options"] = PlanOptions(**d["options"])
        if d["estimates"] is not None:
            out["estimates"] = PipelineEstimates(**{k: _tuples(v)
                                                    for k, v in d["estimates"].items()})
        return cls(**out)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> PipelinePlan:
        return cls.from_json(Path(path).read_text())

    # ---- checking it against a pipeline ----------------------------------------------------
    def mismatches(
        self, *, model: nn.Module | None = None, pp: int | None = None, dp: int | None = None,
        tp: int | None = None, schedule: str | None = None, n_microbatches: int | None = None,
        example_inputs: Sequence[torch.Tensor] | None = None,
        fqns_per_stage: Sequence[Sequence[str]] | None = None,
        stage_ranks: Sequence[int] | None = None, loss_fn: Callable | None = None,
        keyword_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> list[str]:
        """What differs between the plan and the given pipeline (arguments left None are
        not checked), one phrase each."""
        out: list[str] = []

        def differ(what: str, mine: Any, theirs: Any) -> None:
            if theirs is not None and mine != theirs:
                out.append(f"{what}: the plan has {mine}, this pipeline {theirs}")

        if model is not None and self.model != model_fingerprint(model):
            if self.model_structure:
                why = (structure_difference(self.model_structure, model)
                       or "the same parameters and buffers, tied differently")
                out.append(f"model: {why}")
            else:
                out.append(f"model (structural fingerprint): the plan has {self.model}, this "
                           f"pipeline {model_fingerprint(model)} (the plan does not record its "
                           "model's parameters, so what differs is unknown)")
        differ("pp", self.pp, pp)
        differ("dp", self.dp, dp)
        differ("tp", self.tp, tp)
        differ("schedule", self.schedule, None if schedule is None else str(schedule))
        differ("n_microbatches", self.n_microbatches, n_microbatches)
        if example_inputs is not None:
            differ("input shapes", [list(s) for s in self.input_shapes],
                   [list(x.shape) for x in example_inputs])
            differ("input dtypes", list(self.input_dtypes), [str(x.dtype) for x in example_inputs])
        if keyword_inputs is not None:
            from autopp.sharding.plan import describe_keyword_inputs

            differ("keyword inputs (name, shape, dtype)",
                   [[n, list(s), d] for n, s, d in self.keyword_inputs],
                   [[n, list(s), d] for n, s, d in describe_keyword_inputs(keyword_inputs)])
        if fqns_per_stage is not None:
            from autopp.format import compact_modules

            mine = [compact_modules(f) for f in self.fqns_per_stage]
            theirs = [compact_modules(f) for f in fqns_per_stage]
            if [list(f) for f in self.fqns_per_stage] != [list(f) for f in fqns_per_stage]:
                out.append(f"split: the plan has {mine}, this pipeline {theirs}")
        differ("stage placement on pp ranks", list(self.stage_ranks),
               None if stage_ranks is None else list(stage_ranks))
        if loss_fn is not None and self.loss_placement == "vocab":
            from autopp.loss import cross_entropy

            if loss_fn is not cross_entropy:
                out.append("loss: the plan computes the loss in parallel over tp (loss "
                           "parallel), which needs loss_fn=autopp.cross_entropy, got "
                           f"{getattr(loss_fn, '__name__', loss_fn)!r}")
        return out

    def check(self, **pipeline: Any) -> None:
        """Raise ValueError naming every difference (see :meth:`mismatches`) and the fix."""
        diffs = self.mismatches(**pipeline)
        if diffs:
            raise ValueError(
                "the pipeline plan does not match this pipeline: " + "; ".join(diffs)
                + ". Run it with what it was made for, or plan this pipeline instead: leave "
                "out plan= (pipeline_autoparallel then plans it), or make a new plan with "
                "autopp.plan_pipeline(...)"
            )

    # ---- printing it ----------------------------------------------------------------------
    def degraded(self) -> list[str]:
        """Every fallback that changed this plan, as "stage s: what" (see
        :meth:`autopp.sharding.plan.StagePlan.degraded`); empty when none."""
        return [f"stage {s}: {what}" for s, plan in enumerate(self.stage_plans)
                for what in plan.degraded()]

    def check_strict(self) -> None:
        """Raise ValueError listing :meth:`degraded` when there is any: what
        ``PlannerOptions(strict=True)`` asks for on every rank."""
        if bad := self.degraded():
            raise ValueError(
                f"strict planning: {len(bad)} fallback(s) changed the plan: "
                + "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
                + ". Register a DTensor sharding rule (or a FLOP formula) for these ops, or "
                "plan with PlannerOptions(strict=False) to accept them")

    def describe(self) -> str:
        """The plan as text: mesh, schedule, options, each stage, tied parameters, estimates."""
        from autopp.plan.loss_choice import describe_loss
        from autopp.format import compact_modules, format_bytes
        from autopp.sharding.report import placement_summary
        from autopp.sharding.plan import CAP_DROPPED, FLOP_FAILURE, NEAR_OPTIMAL

        o = self.options
        mib = 2**20
        lines = [
            f"PipelinePlan for model {self.model}: pp={self.pp} x dp={self.dp} x tp={self.tp}, "
            f"schedule {self.schedule}, {self.n_microbatches} microbatches, inputs per dp rank "
            + ", ".join(f"{list(s)} {d}" for s, d in zip(self.input_shapes, self.input_dtypes))
            + "".join(f", {n}={list(s)} {d}" for n, s, d in self.keyword_inputs),
            f"  planned with profile {o.profile}, parameter-memory budget "
            + ("none" if o.memory_budget_bytes is None else f"{o.memory_budget_bytes / mib:.1f} MiB")
            + f", boundary {o.boundary}, loss_parallel {o.loss_parallel}, "
            + ("full precision" if o.param_dtype is None
               else f"parameters computed in {o.param_dtype}, gradients reduced in {o.reduce_dtype}")
            + (", fp32 matmuls priced at TF32 (torch's precision 'high'/'medium' or allow_tf32)"
               if o.tf32 else ", fp32 matmuls priced at fp32 (no TF32)"),
        ]
        for s, (fqns, plan) in enumerate(zip(self.fqns_per_stage, self.stage_plans)):
            lines += [
                f"  stage {s} (pp rank {self.stage_ranks[s]}): {compact_modules(fqns)}",
                f"    in {self.boundaries[s]}, out {self.boundaries[s + 1]}; "
                f"{(plan.step_time_s + plan.loss_s) * 1e3:.3f} ms per microbatch; params "
                f"{plan.param_bytes_per_device / mib:.2f} MiB/device; recompute "
                f"{self.recompute[s]}",
                "    inputs (dp-global microbatch): " + ", ".join(
                    f"{n} {list(shape)} {dtype.split('.')[-1]}"
                    for n, shape, dtype in self.stage_inputs[s])
                + (f"; sends {format_bytes(self.send_bytes[s])} per device and microbatch"
                   if self.send_bytes[s] else ""),
                f"    placements: {placement_summary(plan)}",
                *([f"    once-per-step collectives: {plan.hidden_comm_s * 1e3:.3f} ms a step "
                   f"expected hidden beside compute (windows: gathers "
                   f"{plan.comm_windows_s[0] * 1e3:.3f} ms, reductions "
                   f"{plan.comm_windows_s[1] * 1e3:.3f} ms)"]
                  if any(getattr(plan, "comm_windows_s", ())) else []),
                *[f"    {n}" for n in plan.notes
                  if n.startswith(("once-per-step collectives", NEAR_OPTIMAL))],
                *([f"    replicated for want of a DTensor rule: {len(plan.fallbacks)} ops "
                   f"({', '.join(plan.fallbacks[:3])}{', ...' if len(plan.fallbacks) > 3 else ''})"]
                  if plan.fallbacks else []),
                *[f"    {n}" for n in plan.degraded() if n.startswith((FLOP_FAILURE, CAP_DROPPED))],
            ]
        lines.append(f"  {describe_loss(self.loss_placement)}")
        tied = sorted({(f, "/".join(p)) for d in self.tied_placements for f, p in d})
        if tied:
            lines.append("  tied parameters fixed to: " + ", ".join(f"{f} {p}" for f, p in tied))
        e = self.estimates
        if e is not None:
            lines.append(f"  estimated step {e.step_time_s * 1e3:.3f} ms (simulated), bubble "
                         f"{e.bubble_fraction:.1%}; Alpa's closed form {e.alpa_time_s * 1e3:.3f} ms")
            for r, (peak, cats) in enumerate(zip(e.peak_bytes, e.memory_at_peak)):
                lines.append(f"    pp rank {r}: peak {peak / mib:.1f} MiB per device "
                             f"({', '.join(f'{c} {b / mib:.1f}' for c, b in cats)}); "
                             + ("fits" if peak <= e.usable_bytes else "does NOT fit")
                             + f" {e.usable_bytes / mib:.0f} MiB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _tuples(x: Any) -> Any:
    return tuple(_tuples(y) for y in x) if isinstance(x, list) else x


def as_pipeline_plan(plan: PipelinePlan | str | os.PathLike) -> PipelinePlan:
    """``plan``, or the plan saved at that path."""
    if isinstance(plan, PipelinePlan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return PipelinePlan.load(plan)
    raise TypeError(f"plan must be a PipelinePlan or a path to one, got {type(plan).__name__}")


