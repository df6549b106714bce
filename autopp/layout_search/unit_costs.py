"""What each unit (the pre modules, a layer of each kind, the post modules) costs on a (dp, tp)
sub-mesh, from the planner's own plans of probe stages, and how it scales with the microbatch.

What: per sub-mesh shape and recomputation policy, :func:`probe_costs` plans (unbudgeted,
through the plan cache) ``[pre, first layer]``, ``[last layer, post]`` and one layer of each
other kind (:func:`layer_kinds`: dense and mixture-of-experts layers differ), and splits each
:class:`UnitCost` into what scales with the microbatch (compute, activations) and what does
not (parameters and their state, gathered weights, once-per-step collectives). Why: every
layout on that sub-mesh is then priced by rescaling, without planning again. Invariant: the
placements are those the ILP chose at the reference microbatch, so the ranking is an
estimate; the chosen layout's exact plan (:func:`autopp.plan_pipeline`) is the check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopp.estimate.stage_costs import StateBytes, param_dtypes, state_bytes
from autopp.sharding.plan import StagePlan
from autopp.profiles.lookup import get_profile
from autopp.profiles.collectives import collective_latency_s
from autopp.profiles.devices import mesh_links

__all__ = ["LEAN_PRICE", "ShapeCosts", "UnitCost", "layer_kinds", "probe_costs"]

LEAN_PRICE = 8.0
"""Memory-lean probes pay this many times the time-optimal plan's seconds per counted byte
(weights get dp-sharded, activations recomputed or resharded, where that buys memory
cheaply)."""


@dataclass(frozen=True, slots=True)
class UnitCost:
    """One unit on one device of its sub-mesh, at the reference microbatch."""

    per_microbatch_s: float
    """Forward + backward of one microbatch (compute, activation redistributions and the
    recomputed forward, if any): scales with the microbatch, but for ``latency_s``."""
    recompute_s: float
    """Of which the recomputed forward (runs in the backward)."""
    unshard_s: float
    """Parameter gathers and casts, once per step."""
    reduce_grad_s: float
    """Gradient reductions, once per step."""
    activation_bytes: float
    """Saved for the backward per microbatch: scales with the microbatch."""
    gathered_bytes: float
    """Gathered / cast weights held for the step."""
    state: StateBytes
    """Parameters, gradients (reduced and before reduction) and AdamW state."""
    latency_s: float = 0.0
    """Of ``per_microbatch_s``, the activation collectives' fixed latency (does not scale)."""
    kept_for_w_bytes: float = 0.0
    """What a split backward keeps from I to W per microbatch: scales with the microbatch."""

    def __add__(self, other: UnitCost) -> UnitCost:
        return UnitCost(
            self.per_microbatch_s + other.per_microbatch_s,
            self.recompute_s + other.recompute_s, self.unshard_s + other.unshard_s,
            self.reduce_grad_s + other.reduce_grad_s,
            self.activation_bytes + other.activation_bytes,
            self.gathered_bytes + other.gathered_bytes,
            StateBytes(**{f.name: getattr(self.state, f.name) + getattr(other.state, f.name)
                          for f in dataclasses.fields(StateBytes)}),
            self.latency_s + other.latency_s, self.kept_for_w_bytes + other.kept_for_w_bytes)

    def times(self, k: int) -> UnitCost:
        """``k`` of this unit in one stage (``k`` layers)."""
        return UnitCost(
            self.per_microbatch_s * k, self.recompute_s * k, self.unshard_s * k,
            self.reduce_grad_s * k, self.activation_bytes * k, self.gathered_bytes * k,
            StateBytes(**{f.name: getattr(self.state, f.name) * k
                          for f in dataclasses.fields(StateBytes)}),
            self.latency_s * k, self.kept_for_w_bytes * k)

    def scaled(self, factor: float) -> UnitCost:
        """At ``factor`` times the reference microbatch (collective latency unscaled)."""
        fixed = min(self.latency_s, self.per_microbatch_s)
        return dataclasses.replace(self, per_microbatch_s=fixed + (self.per_microbatch_s - fixed)
                                   * factor,
                                   recompute_s=self.recompute_s * factor,
                                   activation_bytes=self.activation_bytes * factor,
                                   kept_for_w_bytes=self.kept_for_w_bytes * factor)

    def state_total(self) -> float:
        s = self.state
        return s.parameters + max(s.gradients, s.unreduced_gradients) + s.optimizer


ZERO = UnitCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, StateBytes(parameters=0, gradients=0,
                                                          unreduced_gradients=0, optimizer=0),
                0.0)


@dataclass(frozen=True, slots=True)
class ShapeCosts:
    """The units of a model on one (dp, tp) sub-mesh at a reference microbatch, per
    recomputation policy (:func:`probe_costs`)."""

    dp: int
    tp: int
    rows: int
    """dp-global rows of the reference microbatch."""
    boundary: str
    """The stage-boundary placement the probes were planned with."""
    pre: dict[str, UnitCost]
    layer: dict[str, tuple[UnitCost, ...]]
    """Per policy, one layer of each kind (:func:`layer_kinds`), in kind order."""
    post: dict[str, UnitCost]
    loss_s: float
    """The loss of one reference microbatch (last stage)."""
    hidden_bytes: float
    """A layer's output for the reference microbatch (dp-global): what stages send."""
    planning_s: float
    solved: int
    """Stage plans solved (the rest came from the plan cache)."""
    loss_kept_bytes: float = 0.0
    """What the last stage's loss keeps per microbatch in flight outside the ILP's memory
    row, per device, at the reference microbatch (:func:`autopp.plan.budgets.loss_kept_bytes`:
    the exact planner takes it off the last stage's budget, and so does the search)."""
    experts: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Per policy and layer kind, where its plan puts the routed experts and how tokens reach
    them (:func:`expert_layout`); "" for a layer without routed experts."""


def _unit_cost(plan: StagePlan, prefix: str, fqns: set[str], dtypes: dict[str, torch.dtype],
               n_microbatches: int) -> UnitCost:
    (bp,) = [b for b in plan.blocks if b.prefix == prefix]
    params = tuple(p for p in plan.params if p.fqn in fqns)
    mine = dataclasses.replace(plan, params=params,
                               collectives=tuple(c for c in plan.collectives
                                                 if c.block == prefix))
    gather = sum(c.time_s for c in mine.collectives if c.producer in fqns and c.node not in fqns)
    reduce = sum(c.time_s for c in mine.collectives if c.node in fqns)
    links = mesh_links(get_profile(plan.profile), tuple(plan.mesh_shape))
    dims = list(plan.mesh_dim_names)
    latency = sum(collective_latency_s(c.kind, plan.mesh_shape[i], links.latency[i])
                  for c in mine.collectives
                  if c.node not in fqns and c.producer not in fqns and c.mesh_dim in dims
                  for i in (dims.index(c.mesh_dim),))
    return UnitCost(
        per_microbatch_s=max(bp.estimated_s - gather - reduce, 0.0),
        recompute_s=bp.recompute_s,
        unshard_s=gather * n_microbatches, reduce_grad_s=reduce * n_microbatches,
        activation_bytes=float(bp.activation_bytes),
        gathered_bytes=float(bp.gathered_param_bytes),
        state=state_bytes(mine, dtypes),
        latency_s=latency,
        kept_for_w_bytes=float(bp.kept_for_w_bytes),
    )


def layer_kinds(model: nn.Module, layout: Any) -> tuple[int, ...]:
    """Per layer, the index of its kind (0: the first layer's): layers of one kind have the
    same module classes, parameter and buffer shapes and dtypes, by name, and the settings
    adapters register as changing a trace (:func:`autopp.tracing.trace_settings`: a sliding
    window). Why: a model whose dense layers come before its mixture-of-experts layers prices
    each kind at its own probe's cost. Invariant: found from the modules alone (no trace)."""
    from autopp.tracing import trace_settings

    seen: dict[tuple, int] = {}
    out = []
    for fqn in layout.layer_fqns:
        m = model.get_submodule(fqn)
        sig = (tuple((n, type(x).__qualname__, trace_settings(x)) for n, x in m.named_modules()),
               tuple((n, tuple(t.shape), t.dtype) for n, t in
                     [*m.named_parameters(), *m.named_buffers()]))
        out.append(seen.setdefault(sig, len(seen)))
    return tuple(out)


def expert_layout(plan: StagePlan, prefix: str) -> str:
    """Where the unit ``prefix`` of ``plan`` puts its routed experts (the forward's
    ``autopp::routed_experts`` ops) and how tokens reach them: e.g. "dp*tp a2a" (experts
    over dp x tp, tokens sent by all-to-all), "tp ag" (over tp, tokens all-gathered),
    "whole" (every device holds every expert); "" where the unit has none."""
    dims = list(plan.mesh_dim_names)
    seen = []
    for bp in plan.blocks:
        if bp.prefix != prefix:
            continue
        for name, _, ins in bp.nodes:
            if not name.startswith("routed_experts") or "backward" in name:
                continue
            tokens, eids = ins[0], ins[3]
            ep = [d for d, e in zip(dims, eids) if e.startswith("S")]
            a2a = [d for d, e, t in zip(dims, eids, tokens)
                   if e.startswith("S") and t.startswith("S")]
            seen.append("*".join(ep) + (" a2a" if a2a else " ag") if ep else "whole")
    return "/".join(dict.fromkeys(seen))


def probe_costs(model: nn.Module, layout: Any, sub_mesh: Any, *, tokens: torch.Tensor,
                n_microbatches: int, profile: str, boundary: str, loss_kind: str,
                modes: Sequence[str], mixed_precision: Any = None,
                tf32: bool | None = None, kinds: Sequence[int] | None = None) -> ShapeCosts:
    """Plan the probe stages of ``model`` on ``sub_mesh`` and read each unit's cost.

    ``model``, ``layout``: the whole model on meta and its ModelLayout; ``sub_mesh``: a
    ("dp", "tp") mesh of the fake process group; ``tokens``: one step's input on one dp rank
    (meta), cut into ``n_microbatches`` reference microbatches; ``boundary``: the placement
    between stages; ``loss_kind``: the last stage's output placement; ``modes``: the
    recomputation policies to plan, one with ``"@lean"`` appended planned for time plus a
    price on memory (:data:`LEAN_PRICE` times the time-optimal plan's seconds per byte);
    ``kinds``: per layer its kind (:func:`layer_kinds`; None: found here).
    """
    import time

    from autopp.plan.budgets import loss_kept_bytes
    from autopp.plan.boundaries import BOUNDARIES
    from autopp.plan.local_stage import plan_local_stage
    from autopp.sharding import StageMemory, StageRequest
    from autopp.plan.make import loss_time_s
    from autopp.plan.stage_inputs import last_stage_output, stage_meta_inputs
    from autopp.schedules.checks import check_batch_size

    check_batch_size(int(tokens.shape[0]), n_microbatches)  # the reference microbatches
    t0 = time.perf_counter()
    dp, tp = sub_mesh["dp"].size(), sub_mesh["tp"].size()
    layers = layout.layer_fqns
    kinds = tuple(layer_kinds(model, layout) if kinds is None else kinds)
    first = [*layout.pre, layers[0]]
    last = [layers[-1], *layout.post]
    # a kind neither the first nor the last layer is: its first layer probed alone
    middle = [kinds.index(k) for k in range(max(kinds) + 1) if k not in (kinds[0], kinds[-1])]
    probes = ([first, *[[layers[i]] for i in middle], last] if len(layers) > 1
              else [[*layout.pre, layers[0], *layout.post]])
    # per kind, (probe stage, layer index) whose cost it takes
    source = {kinds[-1]: (len(probes) - 1, len(layers) - 1)}
    source.update({kinds[i]: (1 + j, i) for j, i in enumerate(middle)})
    source[kinds[0]] = (0, 0)
    pd = getattr(mixed_precision, "param_dtype", None)
    metas, inputs = stage_meta_inputs(model, probes, tokens, n_microbatches, dp, pd)
    solved = 0
    out: dict[str, dict[str, Any]] = {"pre": {}, "layer": {}, "post": {}}
    experts: dict[str, tuple[str, ...]] = {}
    for mode in modes:
        policy, _, lean = mode.partition("@")
        # one peak of one microbatch's activations: the row is the plain one, and the
        # plans count what a split backward keeps from I to W too (the search weighs it)
        memory = StageMemory(activation_factor=1.0, recompute=policy,
                             optimizer_state_factor=2.0, split_in_flight=((1.0, 0.0),))
        plans = []
        for s, (meta, x) in enumerate(zip(metas, inputs)):
            k_in = "batch" if s == 0 else boundary
            k_out = loss_kind if s == len(metas) - 1 else boundary
            ask = StageRequest(
                module=meta, example_inputs=x, mesh=sub_mesh, profile=profile,
                input_placements=BOUNDARIES[k_in], output_placements=BOUNDARIES[k_out],
                memory=memory, mixed_precision=mixed_precision,
                microbatches_per_grad_reduce=n_microbatches, tf32=tf32)
            p, timing = plan_local_stage(ask, stage_index=s)
            solved += timing.solved
            if lean:  # LEAN_PRICE x the time-optimal plan's own seconds per byte
                price = LEAN_PRICE * p.step_time_s / max(p.memory_bytes, 1)
                p, timing = plan_local_stage(ask.replace(price=price), stage_index=s)
                solved += timing.solved
            plans.append(p)
        first_plan, last_plan = plans[0], plans[-1]
        dts = [param_dtypes(meta) for meta in metas]
        d0, d1 = dts[0], dts[-1]
        units, labels = [], []
        for k in range(len(source)):
            s, i = source[k]
            mine = {f for f in dts[s] if f.startswith(layers[i] + ".")}
            units.append(_unit_cost(plans[s], layers[i], mine, dts[s], n_microbatches))
            labels.append(expert_layout(plans[s], layers[i]))
        out["layer"][mode], experts[mode] = tuple(units), tuple(labels)
        layer0 = {f for f in d0 if f.startswith(layers[0] + ".")}
        pre = {f for f in d0 if f not in layer0}
        out["pre"][mode] = (_unit_cost(first_plan, "pre", pre, d0, n_microbatches)
                            if any(b.prefix == "pre" for b in first_plan.blocks) else ZERO)
        lastl = {f for f in d1 if f.startswith(layers[-1] + ".")}
        post = {f for f in d1 if f not in lastl and f not in pre}
        out["post"][mode] = (_unit_cost(last_plan, "post", post, d1, n_microbatches)
                             if any(b.prefix == "post" for b in last_plan.blocks) else ZERO)
    logits = last_stage_output(metas, inputs, mixed_precision)
    return ShapeCosts(
        dp=dp, tp=tp, rows=int(inputs[0][0].shape[0]), boundary=boundary,
        pre=out["pre"], layer=out["layer"], post=out["post"],
        loss_s=loss_time_s(logits, sub_mesh, profile, loss_kind),
        hidden_bytes=float(inputs[-1][0].numel() * inputs[-1][0].element_size())
        if len(probes) > 1 else 0.0,
        planning_s=time.perf_counter() - t0,
        solved=solved, experts=experts,
        loss_kept_bytes=float(loss_kept_bytes(logits, dp, tp, (loss_kind,), 1)),
    )
