"""Pricing a layout from its sub-mesh's probe costs: the split, the recomputation policy and
weight gathering per stage, a lower bound on the step, and the simulator's step and memory.

What: :meth:`Pricer.split` rescales the costs to the layout's microbatch and tabulates, per
stage and per layers held (per first and end layer when the layers are of several kinds),
the fastest probed policy (gathered once per step or block by block) whose memory fits with
the microbatches in flight; Alpa's stage DP (:func:`~autopp.stage_split.balanced.
balanced_cuts`) splits over it, and the busiest pp rank's compute bounds the step.
:meth:`Pricer.simulate` runs the schedule's action lists for the step, bubble and peaks.
Why: two parts, so dominated layouts are left out before the costly simulation. Invariant:
the cost tail is the dry run's (:mod:`autopp.estimate`); only the unit costs are the
search's own (scaled probe tables, no plan per layout).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from autopp.graph.weight_gathering import WeightGathering, exposed_s
from autopp.plan.objective import boundary_split
from autopp.profiles.devices import matmul_peak
from autopp.schedules import MEMORY_CATEGORIES
from autopp.layout_search.layouts import Layout
from autopp.layout_search.unit_costs import ZERO, ShapeCosts, UnitCost

__all__ = ["Candidate", "Pricer", "Split"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A priced layout (a row of :class:`~autopp.layout_search.search.SearchReport`)."""

    layout: Layout
    fqns_per_stage: tuple[tuple[str, ...], ...]
    """The split: module FQNs per stage."""
    layers_per_stage: tuple[int, ...]
    recompute: tuple[str, ...]
    """Per stage, the recomputation policy that fits."""
    step_time_s: float
    bubble_fraction: float
    tokens_per_s_per_device: float
    mfu: float
    """Model FLOPs utilisation: 6 × parameters × tokens per step over the step time and the
    devices' peak (the profile's, in the compute dtype); attention's own FLOPs not counted;
    for mixture-of-experts models, the parameters a token uses (routed experts: K of E)."""
    peak_bytes: tuple[int, ...]
    """Per pp rank, the simulated peak."""
    usable_bytes: float
    largest: str
    """The largest memory consumers at the fullest rank's peak."""
    simulation: Any = field(default=None, compare=False, repr=False)
    weight_gathering: tuple[str, ...] = ()
    """Per stage, "once_per_step" or "per_block" (``PlannerOptions.weight_gathering``)."""
    experts: tuple[str, ...] = ()
    """Per stage, where its probe plans put the routed experts and how tokens reach them
    (:func:`~autopp.layout_search.unit_costs.expert_layout`; "" without routed experts)."""

    @property
    def fits(self) -> bool:
        return max(self.peak_bytes) <= self.usable_bytes


@dataclass(frozen=True, slots=True)
class Split:
    """A layout's split and stage costs, before simulation (:meth:`Pricer.split`)."""

    layout: Layout
    cuts: tuple[int, ...]
    """Layer indices where stages start (0 first, the layer count last)."""
    recompute: tuple[str, ...]
    costs: tuple[Any, ...]
    """Per stage, its :class:`~autopp.schedules.StageCost`."""
    bound_s: float
    """No step of this split is shorter: the busiest pp rank's compute, nothing else."""
    usable: float
    stage_ranks: tuple[int, ...]
    """Per stage, its pp rank under the layout's schedule."""
    weight_gathering: tuple[str, ...] = ()
    """Per stage, how it holds its gathered weights ("once_per_step" or "per_block")."""
    experts: tuple[str, ...] = ()
    """Per stage, its routed experts' layout (:attr:`Candidate.experts`)."""


def _largest(mem: Any) -> str:
    parts = sorted(((getattr(mem, k), k.replace("_", " ")) for k in MEMORY_CATEGORIES),
                   reverse=True)
    return ", ".join(f"{name} {b / 2**30:.1f} GiB" for b, name in parts[:2] if b)


def _linear(u: UnitCost) -> dict[str, float]:
    """What the memory and time of ``k`` such units add up from (each scales with k)."""
    s = u.state
    return dict(t=u.per_microbatch_s, params=s.parameters, grads=s.gradients,
                unreduced=s.unreduced_gradients, opt=s.optimizer, gathered=u.gathered_bytes,
                act=u.activation_bytes, kept=u.kept_for_w_bytes, rec=u.recompute_s,
                unshard=u.unshard_s, reduce=u.reduce_grad_s)


#: Suffix of a pricing mode whose stage gathers its weights block by block.
PER_BLOCK = "#per_block"


class Pricer:
    """Prices layouts from probe costs (one :class:`ShapeCosts` per sub-mesh shape)."""

    def __init__(self, model: nn.Module, layout_info: Any, *, global_batch: int, seq_len: int,
                 profile: Any, mixed_precision: Any, usable: float, tf32: bool = False,
                 per_block: bool = True, kinds: Any = None):
        self.layout = layout_info
        L = layout_info.n_layers
        # per layer, its kind (None: all alike); with one kind a stage's cost depends on how
        # many layers it holds, else on which: columns by count, or by (first, end) layer
        self.kinds = tuple(kinds) if kinds is not None else (0,) * L
        n_kinds = max(self.kinds, default=0) + 1
        at = np.array([[0] + list(np.cumsum([k == j for k in self.kinds])) for j in
                       range(n_kinds)], dtype=np.float64)  # layers of kind j before i
        if n_kinds == 1:
            self.counts = at[:, :]  # column k: k layers
            self.column = lambda a, b: b - a
        else:
            self.counts = (at[:, None, :] - at[:, :, None]).reshape(n_kinds, -1)
            self.column = lambda a, b: a * (L + 1) + b
        self.per_block = per_block  # stages may gather block by block
        self.global_batch, self.seq_len = global_batch, seq_len
        self.profile, self.usable = profile, usable
        self.shapes: dict[tuple[int, int], ShapeCosts] = {}
        from autopp import adapters

        self.n_params = adapters.active_parameters(model)  # per token: MoE counts K/E experts
        dtype = getattr(mixed_precision, "param_dtype", None) or next(
            model.parameters()).dtype
        self.peak_flops = matmul_peak(profile, dtype, tf32)  # the MFU's denominator

    def add(self, shape: ShapeCosts) -> None:
        """Take a probe's costs (merged with those of other recompute policies)."""
        key = (shape.dp, shape.tp)
        old = self.shapes.get(key)
        if old is not None:
            shape = dataclasses.replace(
                shape, pre={**old.pre, **shape.pre}, layer={**old.layer, **shape.layer},
                post={**old.post, **shape.post}, experts={**old.experts, **shape.experts},
                planning_s=old.planning_s + shape.planning_s,
                solved=old.solved + shape.solved)
        self.shapes[key] = shape

    def split(self, lay: Layout, usable: float | None = None) -> Split | str:
        """The layout's split and stage costs, or why it does not fit. ``usable``: the
        device memory (None: the search's; ``inf``: unbounded, for a lower bound)."""
        from autopp.sharding.ilp.memory_row import held_bytes
        from autopp.plan.budgets import (
            in_flight_per_stage,
            split_in_flight_per_stage,
            workspace_allowance,
        )
        from autopp.schedules.memory_terms import communicator_bytes, receive_buffer_bytes
        from autopp.estimate.stage_costs import (
            StateBytes,
            contended_step_s,
            facts_in_thirds,
            stage_cost,
        )
        from autopp.schedules.actions import compute_order
        from autopp.stage_split.balanced import balanced_cuts

        shape = self.shapes[lay.dp, lay.tp]
        usable = self.usable if usable is None else usable
        n, L, m = lay.n_stages, self.layout.n_layers, lay.n_microbatches
        probed = list(shape.layer)  # policies, and their "@lean" variants, probed
        # each also with its weights gathered block by block (one-block prefetch)
        modes = probed + ([m + PER_BLOCK for m in probed] if self.per_block else [])
        f = self.global_batch / m / shape.rows
        layer = {md: tuple(u.scaled(f) for u in shape.layer[md.removesuffix(PER_BLOCK)])
                 for md in modes}
        pre = {md: shape.pre[md.removesuffix(PER_BLOCK)].scaled(f) for md in modes}
        post = {md: shape.post[md.removesuffix(PER_BLOCK)].scaled(f) for md in modes}
        loss = shape.loss_s * f
        in_flight = in_flight_per_stage(lay.schedule, lay.pp, m, n)
        split = split_in_flight_per_stage(lay.schedule, lay.pp, m, n)
        # the boundary activation: batch over dp, sequence over tp
        send = shape.hidden_bytes * f / boundary_split(shape.dp, shape.tp, "batch+seq")
        k_rank = lay.stages_per_rank
        if math.isinf(usable):
            rank_share = math.inf
        else:  # what the exact planner takes off before its ILP's row (plan.budgets)
            comm = communicator_bytes(self.profile.communicator_bytes, (lay.pp, lay.dp, lay.tp))
            rank_share = (usable - workspace_allowance(usable)[1] - comm) / k_rank

        def budget_of(kind: tuple[int, tuple, bool, bool]) -> float:
            """A stage's budget for what the ILP's row counts, as the exact planner sets it:
            the rank's share less the stage's receive buffers and, on the last stage, what
            its loss keeps per microbatch in flight."""
            held, _, first, last = kind
            recv = receive_buffer_bytes(m, 0 if first else int(send), 0 if last else int(send))
            return rank_share - recv - (held * shape.loss_kept_bytes * f if last else 0.0)
        counts, column = self.counts, self.column
        ks = counts.sum(axis=0)  # layers held, per column
        c0 = counts[0]

        def need_and_time(kind: tuple[int, tuple, bool, bool]
                          ) -> tuple[np.ndarray, np.ndarray]:
            """(bytes, seconds) per policy (rows) and layers held (columns); activations
            held as the exact planner's row holds them (``MemorySpec.held_bytes``)."""
            held, peaks, first, last = kind
            need, time = [], []
            for md in modes:
                per_kind = [_linear(u) for u in layer[md]]
                ends = [_linear(e) for e, on in ((pre[md], first), (post[md], last)) if on]
                a0 = per_kind[0]
                col = {k: a0[k] * c0 + sum(e[k] for e in ends) for k in a0}
                for a, c in zip(per_kind[1:], counts[1:]):  # other kinds of layers
                    col = {k: v + a[k] * c for k, v in col.items()}
                acts = held_bytes(held, peaks, col["act"], col["kept"])
                if not md.endswith(PER_BLOCK):
                    need.append(col["params"] + np.maximum(col["grads"], col["unreduced"])
                                + col["opt"] + col["gathered"] + acts)
                    time.append(col["t"] + (loss if last else 0.0))
                    continue
                # block by block: two blocks' gathered weights, gradients held reduced; the
                # gathers run again in every F and I, the reductions in every W, each as
                # exposed beside the compute (F = I = W a third, I re-running the forward)
                largest = max([per_kind[0]["gathered"]] + [e["gathered"] for e in ends]) \
                    if len(per_kind) == 1 else np.max(
                        [np.where(c > 0, a["gathered"], 0.0) for a, c in zip(per_kind, counts)]
                        + [np.full_like(ks, e["gathered"]) for e in ends], axis=0)
                need.append(col["params"] + col["grads"] + col["opt"] + acts
                            + np.minimum(col["gathered"], 2 * largest))
                units = ks + sum(1 for e, on in ((self.layout.pre, first),
                                                 (self.layout.post, last)) if e and on)
                third = (col["t"] - col["rec"]) / 3
                time.append(col["t"] + (loss if last else 0.0)
                            + exposed_s(col["unshard"], third, units)
                            + exposed_s(col["unshard"], third + col["rec"], units)
                            + exposed_s(col["reduce"], third, units))
            return np.array(need), np.array(time)

        kinds = [(in_flight[s], split[s], s == 0, s == n - 1) for s in range(n)]
        tables: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for kind in set(kinds):
            need, time = need_and_time(kind)
            t = np.where(need <= budget_of(kind), time, np.inf)
            best = t.argmin(axis=0)
            cost = t[best, np.arange(t.shape[1])]
            _, _, first, last = kind
            if not (n > L and ((first and self.layout.pre) or (last and self.layout.post))):
                cost[ks == 0] = np.inf  # a stage holds a layer (see the end stages below)
            tables[kind] = (cost, best, need)
        # a first / last stage of only the modules before / after the blocks: only where
        # there are more stages than blocks (the probes price such stages less exactly:
        # measured 11% over the exact plan where it won on the 6-layer debug model)
        ends = bool(self.layout.pre or self.layout.post) and n > L
        cuts = balanced_cuts([1.0] * L, n, stage_table=[
            tables[k][0].reshape(-1, L + 1) if counts.shape[1] > L + 1 else tables[k][0]
            for k in kinds], empty_ends=ends)
        if cuts is None:  # name the stage of the even split that is furthest over
            even = balanced_cuts([1.0] * L, n, empty_ends=ends)
            over = []
            for s, (a, b) in enumerate(zip(even, even[1:])):
                need = tables[kinds[s]][2][:, column(a, b)]
                i = int(need.argmin())
                over.append((float(need[i]), s, a, b, modes[i]))
            got, s, a, b, least = max(over)
            k = b - a
            lean = (", memory-lean placements" if "@" in least else "") + (
                ", weights gathered block by block" if least.endswith(PER_BLOCK) else "")
            u = self._layers(layer[least], a, b)
            u = u + pre[least] if s == 0 else u
            u = u + post[least] if s == n - 1 else u
            st = u.state
            grads = ("gradients before their once-per-step reduction", st.unreduced_gradients) \
                if st.unreduced_gradients > st.gradients and not least.endswith(PER_BLOCK) \
                else ("gradients", st.gradients)
            parts = sorted([("parameters", st.parameters), grads, ("optimizer state", st.optimizer),
                            ("gathered weights", min(u.gathered_bytes, 2 * max(
                                *(x.gathered_bytes for x in layer[least]),
                                pre[least].gathered_bytes,
                                post[least].gathered_bytes)) if least.endswith(PER_BLOCK)
                             else u.gathered_bytes),
                            (f"activations x {in_flight[s]} in flight",
                             in_flight[s] * u.activation_bytes) if not split[s] else
                            ("activations and what W keeps from I, held at the peak",
                             held_bytes(None, split[s], u.activation_bytes,
                                        u.kept_for_w_bytes))], key=lambda p: -p[1])
            largest = ", ".join(f"{name} {b / 2**30:.1f} GiB" for name, b in parts[:3] if b)
            return (f"does not fit: stage {s} ({k} layers) needs ~{got / 2**30:.1f} GiB of "
                    f"{budget_of(kinds[s]) / 2**30:.1f} GiB even under its least-memory plan probed "
                    f"(recompute={least.split('@')[0]!r}{lean}: {largest}), and no split "
                    "does better")
        costs, chosen, gatherings, work, experts = [], [], [], [0.0] * lay.pp, []
        _, stage_to_rank = compute_order(lay.schedule, pp=lay.pp, n_microbatches=m, n_stages=n)
        for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
            mode = modes[int(tables[kinds[s]][1][column(a, b)])]
            u = self._layers(layer[mode], a, b)
            if s == 0:
                u = u + pre[mode]
            if s == n - 1:
                u = u + post[mode]
            ls = loss if s == n - 1 else 0.0
            units = [layer[mode][self.kinds[i]] for i in range(a, b)] + [e for e, mods, on in (
                (pre[mode], self.layout.pre, s == 0), (post[mode], self.layout.post, s == n - 1))
                if mods and on]
            facts = facts_in_thirds(u.per_microbatch_s, recompute_s=u.recompute_s,
                                    unshard_s=u.unshard_s, reduce_grad_s=u.reduce_grad_s,
                                    activation_bytes=int(u.activation_bytes),
                                    kept_for_w_bytes=int(u.kept_for_w_bytes),
                                    gathered_bytes=int(u.gathered_bytes), units=len(units),
                                    largest_unit_gathered_bytes=int(max(
                                        x.gathered_bytes for x in units)))
            state = StateBytes(**{f.name: int(getattr(u.state, f.name))
                                  for f in dataclasses.fields(StateBytes)})
            per_block = mode.endswith(PER_BLOCK)
            cost = stage_cost(facts, state, loss_s=ls,
                              p2p_bytes=int(send) if s < n - 1 else 0,
                              gathering=WeightGathering(per_block=per_block))
            costs.append(cost)
            chosen.append(mode.split("@")[0].removesuffix(PER_BLOCK))
            labels = shape.experts.get(mode.removesuffix(PER_BLOCK), ())
            experts.append("/".join(dict.fromkeys(
                labels[k] for k in sorted(set(self.kinds[a:b])) if k < len(labels) and labels[k])))
            gatherings.append("per_block" if per_block else "once_per_step")
            work[stage_to_rank[s]] += m * (cost.forward_s + cost.backward_input_s
                                           + cost.backward_weight_s)
        bound = contended_step_s(max(work), sum(work) / len(work), self.profile,
                                 lay.pp * lay.dp * lay.tp)
        return Split(lay, tuple(cuts), tuple(chosen), tuple(costs), bound, usable,
                     tuple(stage_to_rank), tuple(gatherings), tuple(experts))

    def _layers(self, per_kind: tuple[UnitCost, ...], a: int, b: int) -> UnitCost:
        """Layers ``a .. b-1`` together, each at its own kind's cost."""
        out = ZERO
        for k, u in enumerate(per_kind):
            n = sum(1 for x in self.kinds[a:b] if x == k)
            if n:
                out = out + u.times(n)
        return out

    def simulate(self, sp: Split) -> Candidate | str:
        """Simulate a split's schedule: its candidate, or why its peak memory does not fit."""
        from autopp.estimate.pipeline import simulate_stages
        from autopp.estimate.stage_costs import simulated_step_s
        from autopp.stage_split.balanced import stage_fqns

        lay = sp.layout
        sim = simulate_stages(lay.schedule, sp.costs, pp=lay.pp,
                              n_microbatches=lay.n_microbatches, stage_ranks=sp.stage_ranks,
                              profile=self.profile, mesh_shape=(lay.pp, lay.dp, lay.tp))
        peaks = tuple(r.peak_bytes for r in sim.ranks)
        worst = max(range(len(peaks)), key=lambda r: peaks[r])
        largest = _largest(sim.ranks[worst].memory_at_peak)
        if peaks[worst] > sp.usable:
            return (f"does not fit: pp rank {worst} peaks at {peaks[worst] / 2**30:.1f} GiB > "
                    f"{sp.usable / 2**30:.1f} GiB usable ({largest})")
        cuts = sp.cuts
        fqns = stage_fqns(self.layout, cuts)
        world = lay.pp * lay.dp * lay.tp
        tokens = self.global_batch * self.seq_len
        step = simulated_step_s(sim, self.profile, world)
        return Candidate(
            layout=lay, fqns_per_stage=tuple(tuple(x) for x in fqns),
            layers_per_stage=tuple(b - a for a, b in zip(cuts, cuts[1:])),
            recompute=sp.recompute, step_time_s=step, bubble_fraction=sim.bubble_fraction,
            tokens_per_s_per_device=tokens / step / world,
            mfu=6 * self.n_params * tokens / step / (world * self.peak_flops),
            peak_bytes=peaks, usable_bytes=sp.usable, largest=largest, simulation=sim,
            weight_gathering=sp.weight_gathering, experts=sp.experts,
        )
