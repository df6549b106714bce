"""``plan_stage``: the planner's one-call entry point (trace, enumerate, price, solve, chain).

It builds the stage as positions of distinct units (:class:`~autopp.sharding.budget.Stage`:
planned flat, or unit by unit with identical units traced and modelled once, memoised
across calls in :data:`_MEMO`), lets :func:`autopp.sharding.budget.choose_chain` pick one
solution per position under the memory budget and the recomputation policy (how: that
module's docstring), and assembles the chosen solutions into a :class:`StagePlan`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopp import tracing
from autopp._compat import sharding as compat
from autopp.sharding.budget import (
    CERTIFIED_GAP,
    MODES,
    Chain,
    DistinctUnit,
    Stage,
    chain_at_price,
    choose_chain,
)
from autopp.sharding.chain import (
    TracedBlock,
    block_restrictions,
    boundary_candidates,
    trace_unit,
)
from autopp.sharding.units import POST, PRE, Unit, stage_units, unit_signature
from autopp.sharding.costs import CostModel
from autopp.sharding.memory_row import MemorySpec
from autopp.graph.walk import param_only_nodes
from autopp.sharding.once_per_step import FREE_WEIGHT, hide_once_per_step, once_kind
from autopp.sharding.precision import check_policy, maybe_cast, reduce_after_cast
from autopp.sharding.plan import CAP_DROPPED, FLOP_FAILURE, NEAR_OPTIMAL, BlockPlan, CollectivePlan, ParamPlan, StagePlan, describe_keyword_inputs, to_strs
from autopp.profiles.devices import DeviceProfile, tf32_enabled
from autopp.profiles.lookup import get_profile
from autopp.sharding.option import PlacementSpec, matches
from autopp.sharding.solution import InfeasiblePlanError
from autopp.sharding.solver import Model
from autopp.sharding.strategies import enumerate_strategies, tensor_vals
from autopp.sharding.trace import check_on_meta, graph_signature, trace_joint
from autopp.sharding.trace_cache import plainest

logger = logging.getLogger(__name__)

DEFAULT = "default"

RecomputeChoice = Literal["none", "selective", "full", "auto"]


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


def plan_stage(
    module: nn.Module,
    example_inputs: tuple[Any, ...],
    mesh,
    *,
    profile: str | DeviceProfile = "H100",
    input_placements: Any = DEFAULT,
    output_placements: Any = DEFAULT,
    param_placements: dict[str, Any] | None = None,
    memory_budget_bytes: float | None = None,
    param_state_factor: float = 1.0,
    time_limit_s: float = 60.0,
    reuse_blocks: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
    microbatches_per_grad_reduce: int = 1,
    largest_tensor_bytes: float | None = None,
    activation_factor: float | None = None,
    split_in_flight: Sequence[tuple[float, float]] = (),
    recompute: RecomputeChoice = "none",
    optimizer_state_factor: float | None = None,
    memory_price: float = 0.0,
    tf32: bool | None = None,
    keyword_inputs: Mapping[str, torch.Tensor] | None = None,
    comm_windows_s: tuple[float, float] = (0.0, 0.0),
    weight_gathering: str = "once_per_step",
    prefetch_blocks: int = 1,
) -> StagePlan:
    """Plan the DP×TP sharding of one stage module on ``mesh`` (its sub-mesh).

    Args:
        module: the stage, on the meta device.
        example_inputs: meta tensors with global shapes (and e.g. ``None`` masks).
        mesh: a DeviceMesh with named dims (``("dp", "tp")``); fake process groups work.
        profile: device profile name or :class:`DeviceProfile` (never read from the machine).
        input_placements / output_placements: "default" (batch ``S(0)`` on dp, ``R``
            elsewhere), None (free), or one placement per mesh dim (None = any).
        param_placements: FQN -> placement per mesh dim, to fix some parameters.
        memory_budget_bytes: per-device bound on what the memory row counts (see
            ``activation_factor``); None = no bound (the memory is still estimated).
        largest_tensor_bytes: no tensor the stage makes and frees within an action (an
            op's output, a redistributed activation) may be larger; plans that would are
            excluded (where none remains, the bound is dropped and the plan's notes say so).
            The pipeline planner passes :data:`autopp.plan.budgets.WORKSPACE_SHARE` of the
            device's memory; None = no bound.
        param_state_factor: parameter state held per parameter byte, all sharded like the
            parameter (e.g. 4 for fp32 parameters + gradients + Adam's two states); the
            legacy way to count state, used when ``optimizer_state_factor`` is None.
        time_limit_s: per ILP.
        reuse_blocks: plan a stage with repeated blocks unit by unit (the part before the
            blocks, each block, the part after; :mod:`autopp.sharding.units`), identical
            blocks once; a stage whose forward does not fit that pattern is planned flat.
        mixed_precision: torch's FSDP2 ``MixedPrecisionPolicy``: parameters computed in
            ``param_dtype``, gradients reduced in ``reduce_dtype`` (see
            :mod:`autopp.sharding.precision`); None = the parameters' own dtype.
        microbatches_per_grad_reduce: the pipeline's microbatches per step: planned stages
            sum their gradients over a step and reduce them once, so reducing a gradient into
            its parameter's placement costs 1/M of its time per microbatch.
        activation_factor: microbatches in flight on this stage (from the schedule
            simulator; 1F1B: min(M, pp - stage index)). Set, the memory row counts the
            parameter state + the values each microbatch saves for its backward × this
            factor + the gathered parameters (held once per step). None: the row counts the
            parameter state only (the legacy parameter-memory budget).
        split_in_flight: with a split backward (zero bubble, DualPipeV), the stage's
            (microbatches between their F and I, microbatches between their I and W) at
            each of its memory peaks (:func:`autopp.schedules.in_flight.split_in_flight`):
            the row then counts the largest of ``a`` × activations + ``b`` × what W keeps
            from I (the weight-gradient graphs' inputs), with ``activation_factor`` set.
            Empty: each backward holds its activations to its end.
        recompute: the backward's activation recomputation: "none", "selective" (save
            matmul / attention outputs), "full" (save the stage's inputs) or "auto" (the
            fastest of the three that fits the budget, recompute time included; see
            :mod:`autopp.sharding.budget`). Recorded in ``StagePlan.recompute``.
        optimizer_state_factor: explicit state categories instead of
            ``param_state_factor``: parameters, their gradients (at the larger of the
            reduced size and the per-step accumulator's, e.g. a dp-sharded weight's full
            gradient before its reduce-scatter) and this many bytes of optimizer state per
            parameter byte, sharded like the parameter (AdamW, fp32 parameters: 2.0).
        memory_price: plan for time + this many seconds per counted byte instead of under
            a budget (``inf``: the least-memory plan, time breaking ties); one recompute
            mode, no budget. The configuration search's memory-lean probes use it.
        tf32: price fp32 matmuls at the profile's TF32 rate (torch lets them use TF32
            tensor cores); None: as torch is set in this process
            (:func:`~autopp.profiles.devices.tf32_enabled`). Recorded in ``StagePlan.tf32``.
        keyword_inputs: keyword inputs of the model's forward the stage takes with every
            microbatch (name -> meta tensor of one microbatch, batch on dim 0, e.g. a padding
            ``attention_mask``): every unit takes them as graph inputs after its
            activation, placed as the batch is (``S(0)`` on dp, ``R`` elsewhere), never
            differentiated; recorded in ``StagePlan.keyword_inputs``. Planned unit by unit
            only (a stage that must be planned flat with them is refused).
        weight_gathering: how the stage will hold its gathered weights and gradients
            (:mod:`autopp.graph.weight_gathering`): "once_per_step" (its gathers and
            reductions priced at 1/M per microbatch, the gathered copy and the unreduced
            accumulator counted whole) or "per_block" (gathers run twice per microbatch and
            reductions once, priced at the share one unit of the stage's exposes, the rest
            prefetched under compute; ``prefetch_blocks`` + 1 of its units' gathered
            weights counted, gradients at their reduced size).
        comm_windows_s: seconds a step during which the stage's once-per-step collectives
            run beside compute on its rank: (its weight gathers, from the step's start to
            its first action; its gradient reductions, from its last backward to the step's
            end), as the schedule leaves them
            (:func:`autopp.schedules.comm_windows.collective_windows`; the pipeline planner
            passes them when collectives run ahead). Where the stage's fastest plan fits
            its budget, the plan is then the faster by what those collectives leave exposed
            of the full-price plan and the time-optimal one with them free; under a binding
            budget the full-price plan stands and its notes bound what the windows could
            gain (:mod:`autopp.sharding.once_per_step`). Recorded in
            ``StagePlan.comm_windows_s`` and ``StagePlan.hidden_comm_s``. Zero: every
            collective is paid in full.

    Raises:
        InfeasiblePlanError: the constraints admit no plan (the message names them; over
            the memory budget: the largest consumers and what would make it fit).
        ValueError: the module or inputs are not on meta, or a constraint is malformed.
    """
    t0 = time.perf_counter()
    check_on_meta(module, example_inputs)
    if recompute not in (*MODES, "auto"):
        raise ValueError(f"recompute must be one of {(*MODES, 'auto')}, got {recompute!r}")
    if optimizer_state_factor is not None and param_state_factor != 1.0:
        raise ValueError("pass optimizer_state_factor (explicit state categories) or "
                         "param_state_factor (one factor for all state), not both")
    if split_in_flight and activation_factor is None:
        raise ValueError("split_in_flight counts activations: pass activation_factor too")
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    prof = get_profile(profile)
    costs = CostModel(prof, tuple(mesh.shape), tf32_enabled() if tf32 is None else tf32)
    shape = tuple(mesh.shape)
    in_spec = _spec(input_placements, names, shape)
    out_spec = _spec(output_placements, names, shape)
    fixed = {k: _spec(v, names, shape) for k, v in (param_placements or {}).items()}
    pdtype = check_policy(mixed_precision, module)
    keyword_inputs = dict(keyword_inputs or {})
    check_on_meta(module, tuple(keyword_inputs.values()))
    units = (stage_units(module, example_inputs[0], keyword_inputs, param_dtype=pdtype)
             if reuse_blocks or keyword_inputs else None)
    per_block = weight_gathering == "per_block"
    if weight_gathering not in ("once_per_step", "per_block"):
        raise ValueError(f"weight_gathering must be 'once_per_step' or 'per_block', got "
                         f"{weight_gathering!r}")
    n_units = len(units) if units is not None else 1
    memory = MemorySpec(param_state_factor, optimizer_state_factor, activation_factor,
                        largest_tensor_bytes=largest_tensor_bytes,
                        split_in_flight=tuple((float(a), float(b)) for a, b in split_in_flight),
                        gathered_share=min(1.0, (prefetch_blocks + 1) / n_units)
                        if per_block else 1.0,
                        gradients_reduced=per_block,
                        gradient_copies=2.0 if microbatches_per_grad_reduce > 1 else 1.0)
    # per microbatch: once per step 1/M each; per block every F and every I gather and
    # every backward reduces, each block's collectives but the first's issued under the
    # compute of the block before it (prefetch): priced at the first block's share, what
    # the estimates find exposed where compute is the longer
    # (:meth:`autopp.graph.weight_gathering.WeightGathering.priced`; they price the rest)
    grad_scale = ((2.0 / n_units, 1.0 / n_units) if per_block
                  else 1.0 / microbatches_per_grad_reduce)
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
            return _flat_stage(module, example_inputs, mesh, costs, memory, in_spec,
                               out_spec, fixed, pdtype, grad_scale, once_weight)
        return _unit_stage(module, units, example_inputs[0], mesh, names, costs, memory,
                           in_spec, out_spec, fixed, pdtype, grad_scale,
                           tuple(keyword_inputs.values()), once_weight)

    stage = build()
    notes: tuple[str, ...] = ()
    modes = MODES if recompute == "auto" else (recompute,)
    # a microbatch; per block there is no UNSHARD or REDUCE_GRAD to hide in a window
    windows = ((0.0, 0.0) if per_block else
               tuple(max(0.0, float(w)) * grad_scale for w in comm_windows_s))
    hidden = 0.0
    if memory_price:
        if recompute == "auto" or memory_budget_bytes is not None:
            raise ValueError("memory_price plans one recompute mode without a budget")
        chosen = chain_at_price(stage, recompute, memory_price, time_limit_s)
        tried, bound = [(recompute, chosen, chosen)], None
    else:
        chosen, tried, bound = choose_chain(stage, modes, memory_budget_bytes, memory,
                                            time_limit_s)
        if any(windows):
            def free(chain: Chain) -> tuple[Stage, Chain | None]:
                st = build(FREE_WEIGHT)
                fast = chain_at_price(st, chain.recompute, 0.0, time_limit_s)
                fits = memory_budget_bytes is None or fast.memory_bytes <= memory_budget_bytes
                return st, fast if fits else None

            stage, chosen, bound, hidden, note = hide_once_per_step(
                stage, chosen, bound, windows, free, CERTIFIED_GAP)
            notes = (note,) if note else ()
    parts = [(stage.units[i], stage.reps[k].traced, res)
             for i, (k, res) in enumerate(zip(stage.kinds, chosen.results))]
    plan = _assemble(parts, stage.solved, mesh, names, prof, costs, memory_budget_bytes, t0,
                     pdtype)
    return dataclasses.replace(
        _with_memory(plan, chosen, tried, recompute, memory),
        keyword_inputs=describe_keyword_inputs(keyword_inputs),
        trace_settings=tuple(tracing.current_settings().items()), tf32=costs.tf32,
        time_bound_s=None if bound is None or not math.isfinite(bound) else bound,
        comm_windows_s=(float(comm_windows_s[0]), float(comm_windows_s[1])),
        hidden_comm_s=hidden * microbatches_per_grad_reduce, notes=plan.notes + notes,
        weight_gathering=weight_gathering)


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
        param_state_factor=memory.param_state_factor,
        optimizer_state_factor=memory.optimizer_state_factor,
        recompute_options=options if requested == "auto" else (),
    )
