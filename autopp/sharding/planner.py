"""``plan_stage``: the planner's one-call entry point (trace, enumerate, price, solve, chain).

It builds the stage as positions of distinct units (:class:`~autopp.sharding.chain.budget.Stage`:
planned flat, or unit by unit with identical units traced and modelled once, memoised
across calls in :data:`_MEMO`), lets :func:`autopp.sharding.chain.budget.choose_chain` pick one
solution per position under the memory budget and the recomputation policy (how: that
module's docstring), and assembles the chosen solutions into a :class:`StagePlan`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Sequence
from typing import Any

import torch

from autopp import tracing
from autopp._compat import sharding as compat
from autopp.sharding.chain.budget import (
    MODES,
    Chain,
    DistinctUnit,
    Stage,
    certified_gap,
    chain_at_price,
    choose_chain,
)
from autopp.sharding.chain.blocks import (
    TracedBlock,
    block_restrictions,
    boundary_candidates,
    trace_unit,
)
from autopp.tracing.units import POST, PRE, Unit, stage_units, unit_signature
from autopp.sharding.cost.model import CostModel
from autopp.sharding.ilp.memory_row import MemorySpec
from autopp.graph.walk import param_only_nodes
from autopp.sharding.chain.once_per_step import FREE_WEIGHT, hide_once_per_step
from autopp.tracing.precision import check_policy, maybe_cast
from autopp.sharding.request import DEFAULT, StageRequest
from autopp.sharding.plan import CAP_DROPPED, FLOP_FAILURE, NEAR_OPTIMAL, BlockPlan, CollectivePlan, ParamPlan, StagePlan, describe_keyword_inputs, to_strs
from autopp.sharding.options.option import PlacementSpec, matches
from autopp.sharding.ilp.solution import InfeasiblePlanError
from autopp.sharding.ilp.solver import Model, once_kind
from autopp.sharding.options.strategies import enumerate_strategies, reduce_after_cast, tensor_vals
from autopp.tracing.joint import check_on_meta, graph_signature, trace_joint
from autopp.tracing.cache import plainest

logger = logging.getLogger(__name__)

def _spec(value: Any, names: Sequence[str], shape: Sequence[int]) -> PlacementSpec | None:
    """Normalise a placement constraint: "default" (batch on dp, replicated elsewhere), None
    (free), or one entry per mesh dim (a torch Placement, a string like "S(0)", or None).
    Size-1 mesh dims are always ``Replicate`` (every placement is the same data there)."""
    from autopp.sharding.plan import parse_placement

    if value is None:
        return None
    if isinstance(value, str) and value == DEFAULT:
        spec = tuple(compat.Shard(0) if n == "dp" else compat.Replicate() for n in names)
    else:
        spec = tuple(parse_placement(v) if isinstance(v, str) else v for v in value)
    if len(spec) != len(names):
        raise ValueError(f"placement constraint {value!r} needs one entry per mesh dim {names}")
    return tuple(compat.Replicate() if n == 1 and p is not None else p for p, n in zip(spec, shape))


def plan_stage(request: StageRequest) -> StagePlan:
    """Plan the DP×TP sharding of one stage module on its (sub-)mesh, as ``request`` asks
    (:class:`~autopp.sharding.request.StageRequest`: its fields say what each choice does).

    Raises:
        InfeasiblePlanError: the constraints admit no plan (the message names them; over
            the memory budget: the largest consumers and what would make it fit).
        ValueError: the module or inputs are not on meta, or a constraint is malformed.
    """
    t0 = time.perf_counter()
    r, spec = request, request.memory
    module, example_inputs, mesh = r.module, r.example_inputs, r.mesh
    check_on_meta(module, example_inputs)
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    prof = r.profile
    costs = CostModel(prof, tuple(mesh.shape), r.tf32)
    shape = tuple(mesh.shape)
    in_spec = _spec(r.input_placements, names, shape)
    out_spec = _spec(r.output_placements, names, shape)
    fixed = {k: _spec(v, names, shape) for k, v in r.param_placements.items()}
    pdtype = check_policy(r.mixed_precision, module)
    keyword_inputs = r.keyword_inputs
    check_on_meta(module, tuple(keyword_inputs.values()))
    units = (stage_units(module, example_inputs[0], keyword_inputs, param_dtype=pdtype)
             if r.reuse_blocks or keyword_inputs else None)
    per_block = spec.weight_gathering == "per_block"
    n_units = len(units) if units is not None else 1
    n_micro = r.microbatches_per_grad_reduce
    memory = MemorySpec(optimizer_state_factor=spec.optimizer_state_factor,
                        activation_factor=spec.activation_factor,
                        largest_tensor_bytes=spec.largest_tensor_bytes,
                        split_in_flight=spec.split_in_flight,
                        gathered_share=min(1.0, (spec.prefetch_blocks + 1) / n_units)
                        if per_block else 1.0,
                        gradients_reduced=per_block,
                        gradient_copies=2.0 if n_micro > 1 else 1.0)
    # per microbatch: once per step 1/M each; per block every F and every I gather and
    # every backward reduces, each block's collectives but the first's issued under the
    # compute of the block before it (prefetch): priced at the first block's share, what
    # the estimates find exposed where compute is the longer
    # (:meth:`autopp.graph.weight_gathering.WeightGathering.priced`; they price the rest)
    grad_scale = (2.0 / n_units, 1.0 / n_units) if per_block else 1.0 / n_micro
    budget, recompute, time_limit_s = spec.budget_bytes, spec.recompute, r.time_limit_s
    if units is None and keyword_inputs:
        from autopp.stage_split.build import is_model_input

        why = (" (autopp_input_*: the model's own inputs, which every stage takes because "
               "its forward reads them, e.g. their shape)"
               if any(is_model_input(k) for k in keyword_inputs) else "")
        raise ValueError(
            f"keyword inputs {sorted(keyword_inputs)}{why}: planned stages take them unit by "
            f"unit (the part before the blocks, each block, the part after), and this stage "
            f"({type(module).__name__}) does not fit that pattern (the log says why at INFO). "
            "Build the pipeline with parallelize=None or your own parallelize function to "
            "pass them")

    def build(once_weight: float = 1.0) -> Stage:
        if units is None:
            st = _flat_stage(module, example_inputs, mesh, costs, memory, in_spec,
                             out_spec, fixed, pdtype, grad_scale, once_weight)
        else:
            st = _unit_stage(module, units, example_inputs[0], mesh, names, costs, memory,
                             in_spec, out_spec, fixed, pdtype, grad_scale,
                             tuple(keyword_inputs.values()), once_weight)
        st.gap = r.optimality_gap
        return st

    stage = build()
    notes: tuple[str, ...] = ()
    modes = MODES if recompute == "auto" else (recompute,)
    # a microbatch; per block there is no UNSHARD or REDUCE_GRAD to hide in a window
    windows = ((0.0, 0.0) if per_block else
               tuple(max(0.0, w) * grad_scale for w in r.comm_windows_s))
    hidden = 0.0
    if spec.price:
        chosen = chain_at_price(stage, recompute, spec.price, time_limit_s)
        tried, bound = [(recompute, chosen, chosen)], None
    else:
        chosen, tried, bound = choose_chain(stage, modes, budget, memory, time_limit_s)
        if any(windows):
            def free(chain: Chain) -> tuple[Stage, Chain | None]:
                st = build(FREE_WEIGHT)
                fast = chain_at_price(st, chain.recompute, 0.0, time_limit_s)
                fits = budget is None or fast.memory_bytes <= budget
                return st, fast if fits else None

            stage, chosen, bound, hidden, note = hide_once_per_step(
                stage, chosen, bound, windows, free, certified_gap(stage))
            notes = (note,) if note else ()
    parts = [(stage.units[i], stage.reps[k].traced, res)
             for i, (k, res) in enumerate(zip(stage.kinds, chosen.results))]
    plan = _assemble(parts, stage.solved, mesh, names, prof, costs, budget, t0, pdtype)
    return dataclasses.replace(
        _with_memory(plan, chosen, tried, recompute, memory),
        keyword_inputs=describe_keyword_inputs(keyword_inputs),
        trace_settings=tuple(tracing.current_settings().items()), tf32=costs.tf32,
        time_bound_s=None if bound is None or not math.isfinite(bound) else bound,
        comm_windows_s=r.comm_windows_s, hidden_comm_s=hidden * n_micro,
        notes=plan.notes + notes, weight_gathering=spec.weight_gathering)


# -- building the stage as positions of distinct units ---------------------------------------


def _flat_stage(module, example_inputs, mesh, costs, memory, in_spec, out_spec, fixed,
                pdtype, grad_scale, once_weight: float = 1.0) -> Stage:
    joint = trace_joint(maybe_cast(module, pdtype), example_inputs)
    traced = TracedBlock(module, joint, enumerate_strategies(joint, mesh), ())
    if pdtype is not None:
        reduce_after_cast(traced.strategies)
    model = Model(traced.strategies, costs, grad_reduce_scale=grad_scale, memory=memory,
                  once_weight=once_weight)
    key = ("in", "out")
    rep = DistinctUnit(Unit("", module), traced, model, ("flat", id(model)),
                       {key: block_restrictions(traced, in_spec, out_spec, fixed)}, ())
    return Stage([rep.unit], [0], [rep], ["in"], ["out"], [(model.num_vars, 0.0)], True)


def _matching(cands: list[tuple], spec: PlacementSpec | None) -> list[tuple]:
    return [c for c in cands if matches(c, spec)]


class _Memo:
    """This process's traced units, their ILP models and solutions, reused across
    ``plan_stage`` calls: planning one stage under several boundary placements, or several
    stages holding identical blocks, traces and solves each distinct unit and boundary pair
    once. Bounded: past :attr:`LIMIT` traced units or models, the least recently used unit
    is forgotten with its models and solutions (a search's probe process goes back to a
    sub-mesh it probed earlier; clearing everything made it trace and build again)."""

    LIMIT = 64
    SOLVES_LIMIT = 4096

    def __init__(self) -> None:
        self.traced: dict[tuple, TracedBlock] = {}
        self.models: dict[tuple, Model] = {}
        self.solves: dict[tuple, Any] = {}

    def unit(self, ukey: tuple) -> TracedBlock | None:
        """A traced unit, now the most recently used."""
        hit = self.traced.pop(ukey, None)
        if hit is not None:
            self.traced[ukey] = hit
        return hit

    def trim(self) -> None:
        while self.traced and (len(self.models) > self.LIMIT or len(self.traced) > self.LIMIT):
            self._forget(next(iter(self.traced)))
        if len(self.models) > self.LIMIT:  # models of no traced unit: none expected
            self.models.clear()
            self.solves.clear()
        if len(self.solves) > self.SOLVES_LIMIT:  # many prices searched: keep the traces
            self.solves.clear()

    def _forget(self, ukey: tuple) -> None:
        """A unit, its models (keyed by the unit first) and their solutions (keyed by the
        model's key first): solutions name the traced unit's nodes."""
        del self.traced[ukey]
        for k in [k for k in self.models if k[0] == ukey]:
            del self.models[k]
        for k in [k for k in self.solves if isinstance(k[0], tuple) and k[0][:1] == (ukey,)]:
            del self.solves[k]


_MEMO = _Memo()


def _unit_stage(module, units, x, mesh, names, costs, memory, in_spec, out_spec, fixed,
                pdtype, grad_scale, inputs: tuple[torch.Tensor, ...] = (),
                once_weight: float = 1.0) -> Stage:
    """Trace each distinct unit once and list the boundary pairs a chain can use (every unit
    also takes the keyword ``inputs``, fixed where the batch is)."""
    _MEMO.trim()
    kw_spec = _spec(DEFAULT, names, tuple(mesh.shape)) if inputs else None
    kw_key = tuple((tuple(t.shape), str(t.dtype)) for t in inputs)
    kinds: list[int] = []
    reps_traced: list[tuple[Unit, TracedBlock, tuple]] = []
    sig_index: dict[tuple, int] = {}
    for unit in units:
        sig = unit_signature(unit)
        if sig not in sig_index:
            sig_index[sig] = len(reps_traced)
            ukey = (sig, tuple(x.shape), str(x.dtype), kw_key, tuple(mesh.shape), names,
                    pdtype, tuple(tracing.current_settings().items()))
            hit = _MEMO.unit(ukey)
            if hit is None:
                t0 = time.perf_counter()
                # on the plainest unit of its signature: the trace key the estimates' and
                # the other stages' units share (a stage's end blocks carry its cut's hooks)
                plain = plainest([u.module for u in units if unit_signature(u) == sig])
                hit = _MEMO.traced[ukey] = trace_unit(plain, x, mesh, inputs,
                                                      param_dtype=pdtype)
                if pdtype is not None:
                    reduce_after_cast(hit.strategies)
                logger.info("unit %s (%s) on mesh %s: traced, %d nodes with options, in "
                            "%.1f s (%d distinct units so far)", unit.name or "<stage>",
                            type(unit.module).__name__, tuple(mesh.shape),
                            len(hit.strategies.nodes), time.perf_counter() - t0,
                            len(_MEMO.traced))
            reps_traced.append((unit, hit, ukey))
        kinds.append(sig_index[sig])
        out = reps_traced[sig_index[sig]][1].joint.outputs[0].meta["val"]
        x = torch.empty(out.shape, dtype=out.dtype, device="meta")
    solved: list[tuple[int, float]] = []
    reps: list[DistinctUnit] = []
    first_in = last_out = None
    for kind, (unit, traced, ukey) in enumerate(reps_traced):
        # the stage's own input (tokens) and output (logits) are not block boundaries
        ends_in = unit.name == PRE
        ends_out = unit.name == POST
        ins = boundary_candidates(traced, names, in_spec if ends_in else None, pattern=not ends_in)
        outs = boundary_candidates(
            traced, names, out_spec if ends_out else None, output=True, pattern=not ends_out
        )
        if kind == kinds[0]:
            first_in = _matching(ins, in_spec)
        if kind == kinds[-1]:
            last_out = _matching(outs, out_spec)
        # only the pairs a chain can use: the stage's ends are constrained
        positions = [i for i, k in enumerate(kinds) if k == kind]
        if all(i == 0 for i in positions):
            ins = first_in
        if all(i == len(kinds) - 1 for i in positions):
            outs = last_out
        local_fixed = {
            f: fixed[unit.stage_fqn(f)]
            for f, _ in traced.module.named_parameters()
            if unit.stage_fqn(f) in fixed
        }
        # the columns' costs depend on the profile and the TF32 rate, the memory row on
        # the accounting (an activation factor per stage's microbatches in flight); per
        # block, a unit the stage has once (its embedding, its output) counts its gathered
        # weights whole: held while it runs, they can dwarf a block's share
        mem = memory if len(positions) > 1 or memory.gathered_share == 1.0 else \
            dataclasses.replace(memory, gathered_share=1.0)
        mkey = (ukey, costs.profile, costs.tf32, mem, grad_scale, once_weight)
        model = _MEMO.models.get(mkey)
        if model is None:  # the columns, once per unit; the memory row per accounting
            base = _MEMO.models.get(mkey[:3] + mkey[4:])
            if base is None:
                t0 = time.perf_counter()
                base = _MEMO.models[mkey[:3] + mkey[4:]] = Model(
                    traced.strategies, costs, grad_reduce_scale=grad_scale, memory=mem,
                    once_weight=once_weight)
                logger.info("unit %s: ILP of %d variables built in %.1f s", unit.name or
                            "<stage>", base.num_vars, time.perf_counter() - t0)
            model = _MEMO.models[mkey] = base.with_memory(mem)
        solved.append((model.num_vars, 0.0))
        pairs = {}
        for a in ins:
            for b in outs:
                pairs[a, b] = block_restrictions(traced, a, b, local_fixed, kw_spec)
        reps.append(DistinctUnit(unit, traced, model, mkey, pairs,
                                 tuple(sorted(local_fixed.items()))))
    if not first_in:
        raise InfeasiblePlanError(
            f"input_placements {in_spec} matches no block-boundary placement"
        )
    if not last_out:
        raise InfeasiblePlanError(
            f"output_placements {out_spec} matches no block-boundary placement"
        )
    return Stage(list(units), kinds, reps, first_in, last_out, solved, False, _MEMO.solves)


# -- assembling the chosen solutions into a StagePlan ----------------------------------------


def _node_labels(j, unit: Unit) -> dict[str, str]:
    """Readable names of graph inputs in reports: parameter FQNs, "input0", "output0" (an
    output's tangent carries the output's placement)."""
    labels = {n.name: unit.stage_fqn(f) for f, n in [*j.params.items(), *j.buffers.items()]}
    labels.update({n.name: f"input{i}" for i, n in j.inputs.items()})
    labels.update({n.name: f"output{i}" for i, n in j.tangents.items()})  # tangent = output
    return labels


def _per_step_kinds(j):
    """(consumer name, producer name) -> the once-per-step action a collective between them
    runs in ("UNSHARD", "REDUCE_GRAD" or ""), as :func:`once_kind` classifies the edge."""
    params = set(j.params.values())
    by_name = {n.name: n for n in j.gm.graph.nodes}
    only = param_only_nodes(j.gm, params)

    def kind(dst: str, src: str) -> str:
        # an edge into a parameter node is its gradient's tie (parameters have no inputs)
        k = once_kind(by_name.get(dst), None if by_name.get(dst) in params else 0,
                      by_name.get(src), params, only)
        return "" if k is None else ("UNSHARD", "REDUCE_GRAD")[k]
    return kind


def _assemble(parts, solved, mesh, names, prof, costs, budget, t0, pdtype=None) -> StagePlan:
    params, colls, block_plans, fallbacks = [], [], [], []
    for unit, traced, res in parts:
        prefix = unit.name
        j = traced.joint
        label = _node_labels(j, unit)
        per_step = _per_step_kinds(j)
        for fqn, node in j.params.items():
            full = unit.stage_fqn(fqn)
            pl = res.choice[node].out[0]
            params.append(ParamPlan(full, to_strs(pl), int(costs.local_bytes(tensor_vals(node)[0], pl))))
        for node_name, producer, c in res.collectives:
            colls.append(
                CollectivePlan(prefix, label.get(node_name, node_name),
                               label.get(producer, producer), c.kind, names[c.mesh_dim],
                               c.bytes, c.time_s, per_step(node_name, producer))
            )
        nodes = tuple(
            (
                n.name,
                tuple(to_strs(p) if p is not None else None for p in o.out),
                tuple(to_strs(p) for p in o.ins),
            )
            for n, o in res.choice.items()
        )
        in_pl = to_strs(res.choice[j.inputs[0]].out[0]) if 0 in j.inputs else ()
        out_pl = to_strs(res.choice[j.tangents[0]].out[0]) if 0 in j.tangents else ()
        block_plans.append(
            BlockPlan(prefix, graph_signature(j), in_pl, out_pl, nodes, res.objective_s,
                      recompute=res.recompute, recompute_s=res.recompute_s,
                      activation_bytes=int(res.activation_bytes),
                      kept_for_w_bytes=int(res.kept_for_w_bytes),
                      gathered_param_bytes=int(res.gathered_bytes),
                      state_bytes=int(res.state_bytes))
        )
        fallbacks += traced.strategies.fallbacks  # "node: op (reason)", shared by equal units
    fallbacks = list(dict.fromkeys(fallbacks))
    results = [r for _, _, r in parts]
    return StagePlan(
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=names,
        profile=prof.name,
        params=tuple(params),
        input_placements=block_plans[0].input_placements,
        output_placements=block_plans[-1].output_placements,
        blocks=tuple(block_plans),
        collectives=tuple(colls),
        step_time_s=sum(r.objective_s for r in results),
        compute_s=sum(r.compute_s for r in results),
        comm_s=sum(r.comm_s for r in results),
        param_bytes_per_device=sum(p.local_bytes for p in params),
        memory_budget_bytes=budget,
        fallbacks=tuple(fallbacks),
        num_vars=sum(n for n, _ in solved),
        solve_s=sum(t for _, t in solved),
        plan_s=time.perf_counter() - t0,
        param_dtype=pdtype,
        notes=(
            "costs: joint fwd+bwd graph as traced (a parameter gathered in forward is not "
            "re-gathered in backward); memory: the ILP's estimate per device (activations "
            "read off the traced joint graph under the recomputation policy)",
            *(f"{FLOP_FAILURE}{op} failed ({why}): priced by its memory traffic only"
              for op, why in sorted(costs.flop_failures.items())),
            *dict.fromkeys(f"{m.group(1)} ({unit.name or 'stage'})" for unit, _, r in parts
                           for note in (CAP_DROPPED, NEAR_OPTIMAL)
                           if (m := re.search(rf"\(({note}[^)]*)\)", r.status))),
        ),
    )


def _with_memory(plan: StagePlan, chosen: Chain, tried, requested: str,
                 memory: MemorySpec) -> StagePlan:
    """``plan`` with the memory estimate and recomputation choice filled in."""
    from dataclasses import replace

    options = tuple(
        (mode, None if fit is None else fit.time_s,
         None if fit is None else float(fit.memory_bytes),
         float(least.memory_bytes if fit is not None or math.isnan(least.memory_bound_bytes)
               else least.memory_bound_bytes))
        for mode, fit, least in tried
    )
    return replace(
        plan,
        recompute=chosen.recompute,
        recompute_requested=requested,
        recompute_s=chosen.total("recompute_s"),
        activation_factor=memory.activation_factor,
        activation_bytes=int(chosen.total("activation_bytes")),
        gathered_param_bytes=int(chosen.total("gathered_bytes")),
        kept_for_w_bytes=int(chosen.total("kept_for_w_bytes")),
        split_in_flight=memory.split_in_flight,
        state_bytes=int(chosen.total("state_bytes")),
        memory_bytes=int(chosen.memory_bytes),
        optimizer_state_factor=memory.optimizer_state_factor,
        recompute_options=options if requested == "auto" else (),
    )
