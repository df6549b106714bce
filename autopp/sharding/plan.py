"""The plan as a value: a frozen dataclass that can be saved, loaded (JSON), printed and diffed.

Placements are stored as short strings per mesh dim: ``"R"`` (replicate), ``"S(d)"`` (shard
tensor dim d), ``"P(sum)"`` (pending reduction).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopp._compat import sharding as compat
from autopp.format import dataclass_json

PlacementStrs = tuple[str, ...]


def placement_str(p: Any) -> str:
    if isinstance(p, compat.Replicate):
        return "R"
    if isinstance(p, compat.StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    if isinstance(p, compat.Shard):
        return f"S({p.dim})"
    if isinstance(p, compat.Partial):
        return f"P({p.reduce_op})"
    raise ValueError(f"unknown placement {p!r}")


def parse_placement(s: str) -> Any:
    s = s.strip()
    if s == "R":
        return compat.Replicate()
    if s.startswith("SS("):
        d, f = s[3:-1].split(",")
        return compat.StridedShard(int(d), split_factor=int(f))
    if s.startswith("S("):
        return compat.Shard(int(s[2:-1]))
    if s.startswith("P("):
        return compat.Partial(s[2:-1])
    raise ValueError(f"cannot parse placement {s!r}; expected R, S(d) or P(op)")


def to_strs(placements: Any) -> PlacementStrs:
    return tuple(placement_str(p) for p in placements)


def from_strs(strs: PlacementStrs) -> tuple[Any, ...]:
    return tuple(parse_placement(s) for s in strs)


@dataclass(frozen=True, slots=True)
class ParamPlan:
    fqn: str
    placements: PlacementStrs
    local_bytes: int


@dataclass(frozen=True, slots=True)
class CollectivePlan:
    block: str
    """Prefix of the block the collective is in ("" for a flat stage)."""
    node: str
    """Node that needs the redistributed value (a parameter node for gradient reductions)."""
    producer: str
    kind: str
    mesh_dim: str
    bytes: int
    time_s: float
    """Per microbatch (a once-per-step collective's time a step / M)."""
    per_step: str = ""
    """Which once-per-step action runs it: "UNSHARD" (out of a parameter-only value: a
    weight, its cast or view), "REDUCE_GRAD" (a gradient into its parameter), or "" (every
    microbatch); :func:`autopp.sharding.chain.once_per_step.once_kind`. Plans saved before it
    existed load with ""."""


@dataclass(frozen=True, slots=True)
class BlockPlan:
    prefix: str
    """FQN prefix of the block's parameters in the stage module ("" for a flat stage)."""
    signature: str
    """Structural key of the block's graph; equal keys share a plan."""
    input_placements: PlacementStrs
    output_placements: PlacementStrs
    nodes: tuple[tuple[str, tuple[PlacementStrs | None, ...], tuple[PlacementStrs, ...]], ...]
    """(node name, output placements, required input placements) of every graph node."""
    estimated_s: float
    recompute: str = "none"
    """The backward's recomputation policy this unit was planned under."""
    recompute_s: float = 0.0
    """Forward time its backward recomputes per microbatch (in :attr:`estimated_s`)."""
    activation_bytes: int = 0
    """Estimated bytes one microbatch saves for this unit's backward, on one device."""
    kept_for_w_bytes: int = 0
    """Estimated bytes a split backward keeps from one microbatch's I to its W for this
    unit, on one device (0 where the plan did not count it)."""
    gathered_param_bytes: int = 0
    """Estimated gathered / cast parameter values it holds once per step."""
    state_bytes: int = 0
    """Parameter state as counted (see :attr:`StagePlan.state_bytes`)."""


FLOP_FAILURE = "FLOP formula of "
"""How a stage plan's note about an op priced without its FLOPs begins."""
CAP_DROPPED = "largest-tensor cap"
"""How a plan's note begins where a unit's solve dropped the largest-tensor bound
(``MemorySpec.largest_tensor_bytes``): its working memory is then not bounded."""
NEAR_OPTIMAL = "time-only plan within"
"""How a plan's note begins where a unit's time-only plan was taken from its fractional LP
relaxation with the integral columns fixed
(:meth:`~autopp.sharding.ilp.highs.WarmLps.fix_and_solve`): within a stated fraction of the optimum, not proven optimal. ``describe()`` shows it; it is not
a fallback that ``strict`` refuses (a solver tolerance, as a MIP gap is)."""


def describe_keyword_inputs(inputs: Any) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``(name, shape, dtype)`` of keyword inputs (name -> tensor), in order."""
    return tuple((name, tuple(int(d) for d in t.shape), str(t.dtype))
                 for name, t in dict(inputs or {}).items())


@dataclass(frozen=True, slots=True)
class StagePlan:
    """A sharding plan for one stage on its sub-mesh."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    profile: str
    params: tuple[ParamPlan, ...]
    input_placements: PlacementStrs
    output_placements: PlacementStrs
    blocks: tuple[BlockPlan, ...]
    collectives: tuple[CollectivePlan, ...]
    step_time_s: float
    """Estimated time of one forward+backward on one device (compute + communication)."""
    compute_s: float
    comm_s: float
    param_bytes_per_device: int
    memory_budget_bytes: float | None
    fallbacks: tuple[str, ...]
    """Ops replicated because DTensor has no working rule for them."""
    num_vars: int
    solve_s: float
    plan_s: float
    notes: tuple[str, ...] = field(default=())
    param_dtype: str | None = None
    """Mixed precision: the dtype parameters are computed in (their masters keep theirs;
    gradients are reduced in the master dtype); None = full precision."""
    loss: str | None = None
    """Last stage of a pipeline: how the loss is computed (loss parallel or on gathered
    logits); None when the plan does not end in the loss."""
    loss_s: float = 0.0
    """Estimated fwd+bwd time of that loss on one device (not in :attr:`step_time_s`)."""
    weight_gathering: str = "once_per_step"
    """How the plan was priced to hold its gathered weights and gradients
    (:mod:`autopp.graph.weight_gathering`): "once_per_step" (each collective that runs in
    UNSHARD or REDUCE_GRAD recorded at 1/M of its time, M microbatches) or "per_block"
    (a gather at 2 / units of its time: every F and I run it, all but one unit's hidden; a
    reduction at 1 / units)."""
    recompute: str = "none"
    """The backward's activation recomputation ("none", "selective", "full"; see
    :mod:`autopp.graph.recompute`): what the plan was made for (chosen when
    :attr:`recompute_requested` is "auto")."""
    recompute_requested: str = "none"
    recompute_s: float = 0.0
    """Estimated forward time the backward recomputes per microbatch, on one device
    (included in :attr:`step_time_s`, not in :attr:`compute_s`)."""
    activation_factor: float | None = None
    """Microbatches in flight the memory row counted activations for (None: activations
    and gathered parameters were not in the budget)."""
    activation_bytes: int = 0
    """Estimated bytes one microbatch saves for the backward on one device, under
    :attr:`recompute` (the ILP's count off the traced joint graphs)."""
    gathered_param_bytes: int = 0
    """Estimated gathered / cast parameter values held once per step (unshard outputs)."""
    kept_for_w_bytes: int = 0
    """With a split backward (:attr:`split_in_flight`): estimated bytes one microbatch
    keeps from its I to its W on one device (the weight-gradient graphs' inputs)."""
    split_in_flight: tuple[tuple[float, float], ...] = ()
    """With a split backward: the (F->I, I->W) microbatch counts at the stage's memory
    peaks the budget was checked at (:attr:`memory_bytes` holds the largest of
    ``a × activation_bytes + b × kept_for_w_bytes``); empty: activations × the factor."""
    state_bytes: int = 0
    """Parameter state as counted: parameters × :attr:`param_state_factor`, or with
    :attr:`optimizer_state_factor`, parameters + optimizer state + gradients (at their
    larger of reduced and unreduced size)."""
    memory_bytes: int = 0
    """What the budget was checked against: state + activation_factor × activations (the
    largest over :attr:`split_in_flight` with a split backward) + gathered (the state alone
    when :attr:`activation_factor` is None)."""
    param_state_factor: float = 1.0
    optimizer_state_factor: float | None = None
    recompute_options: tuple[tuple[str, float | None, float | None, float], ...] = ()
    """With ``recompute="auto"``: each policy planned, as (policy, estimated step time of its
    fastest fitting plan, that plan's counted bytes, the least counted bytes found: of its
    least-memory plan when the budget binds, else of the fastest plan itself, or, where
    the bytes-only LP relaxations proved the policy over the budget without that plan, their
    proven lower bound); None where nothing fits. Policies after "none" are not planned when none's fastest plan fits."""
    tf32: bool = False
    """fp32 matmuls were priced on TF32 tensor cores (:func:`autopp.profiles.devices.tf32_enabled`
    when planned); every later pricing of the stage (estimating it) uses the same rate."""
    trace_settings: tuple[tuple[str, str], ...] = ()
    """The tracing settings the stage was planned under (:mod:`autopp.tracing`: e.g. MoE
    token dispatch), by name; every later trace of it (applying, estimating) uses them."""
    keyword_inputs: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    """The keyword inputs of the model's forward the stage was planned to take with every
    microbatch, as (name, global shape of one microbatch, dtype), in the order its graphs
    take them after the activation (:func:`describe_keyword_inputs`)."""
    cache_entry: str | None = None
    """The plan cache key it was stored or read under (:mod:`autopp.plan.cache`), if any."""
    time_bound_s: float | None = None
    """A proven lower bound on :attr:`step_time_s` of any plan of this stage that fits its
    budget, over the recomputation policies planned, for plans built unit by unit
    (:mod:`autopp.sharding.chain.budget`: weak duality of the memory price, from the solver's own
    bounds); ``step_time_s`` is within ``(step_time_s - time_bound_s) / step_time_s`` of the
    best such plan. None: not computed (a memory-priced probe)."""
    comm_windows_s: tuple[float, float] = (0.0, 0.0)
    """Seconds a step the schedule leaves the stage's once-per-step collectives beside
    compute (its weight gathers, its gradient reductions) when it was planned
    (``StageRequest.comm_windows_s``); zero: none, every collective priced in full."""
    hidden_comm_s: float = 0.0
    """Seconds a step of those collectives the plan expects hidden in those windows
    (:mod:`autopp.sharding.chain.once_per_step`); :attr:`step_time_s` still counts them in full,
    and the schedule simulator hides what the schedule hides."""

    def once_per_step_s(self) -> tuple[float, float]:
        """(UNSHARD, REDUCE_GRAD) seconds per microbatch (1/M of a step's): the collectives
        the plan runs in them (:attr:`CollectivePlan.per_step`: a weight's gathers, its
        cast's or view's included, as the runtime's unshard graph runs them; gradient
        reductions). A plan saved without that field: its redistributions out of a
        parameter itself, and into one (those out of casts and views then count as F's)."""
        if any(c.per_step for c in self.collectives):
            return (sum(c.time_s for c in self.collectives if c.per_step == "UNSHARD"),
                    sum(c.time_s for c in self.collectives if c.per_step == "REDUCE_GRAD"))
        fqns = {p.fqn for p in self.params}
        return (sum(c.time_s for c in self.collectives
                    if c.producer in fqns and c.node not in fqns),
                sum(c.time_s for c in self.collectives if c.node in fqns))

    def once_factors(self, n_microbatches: int) -> tuple[float, float]:
        """What turns the recorded time of a collective run in UNSHARD / REDUCE_GRAD (see
        :attr:`weight_gathering`) into its time in one whole gather / reduction of the
        stage's weights."""
        if self.weight_gathering == "per_block":  # priced at one unit's share of 2 and 1
            return len(self.blocks) / 2, float(len(self.blocks))
        return float(n_microbatches), float(n_microbatches)

    def degraded(self) -> list[str]:
        """What was planned on a fallback that changes the plan: ops replicated because
        DTensor's rule failed or had no option (:attr:`fallbacks`), and ops priced without
        their FLOPs because their formula failed, units planned without the largest-tensor bound
        because no plan met it (both from :attr:`notes`). ``describe()`` shows
        them; ``PlannerOptions(strict=True)`` refuses a plan that has any."""
        return [*(f"replicated for want of a DTensor rule: {f}" for f in self.fallbacks),
                *(n for n in self.notes if n.startswith((FLOP_FAILURE, CAP_DROPPED)))]

    def keyword_examples(self) -> dict[str, Any]:
        """Meta tensors of :attr:`keyword_inputs`, by name, in order (what it re-traces on)."""
        import torch

        return {name: torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]),
                                  device="meta")
                for name, shape, dtype in self.keyword_inputs}

    def param_placements(self) -> dict[str, tuple[Any, ...]]:
        """FQN -> torch placements."""
        return {p.fqn: from_strs(p.placements) for p in self.params}

    def to_json(self, indent: int | None = None) -> str:
        """The plan as JSON (compact by default: a large stage's plan is megabytes, and only
        the compact form is written by the C encoder)."""
        return dataclass_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> StagePlan:
        d = json.loads(text)

        def tup(x):
            return tuple(tup(y) for y in x) if isinstance(x, list) else x

        def build(kind, items):
            return tuple(kind(**{k: tup(v) for k, v in item.items()}) for item in items)

        d["params"] = build(ParamPlan, d["params"])
        d["collectives"] = build(CollectivePlan, d["collectives"])
        d["blocks"] = build(BlockPlan, d["blocks"])
        return cls(**{k: v if k in ("params", "collectives", "blocks") else tup(v)
                      for k, v in d.items()})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> StagePlan:
        return cls.from_json(Path(path).read_text())

    def __str__(self) -> str:
        from autopp.sharding.report import format_plan

        return format_plan(self)
