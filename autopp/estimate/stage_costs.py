"""What a planned stage costs the schedule simulator: one :class:`~autopp.schedules.StageCost`
per stage, derived from its :class:`~autopp.sharding.StagePlan` (and its lowered graphs).

Time: :func:`stage_facts` re-traces each unit and puts every priced node and redistribution
in the runtime piece that runs it: parameter-only work and its gathers in UNSHARD, gradient
reductions in REDUCE_GRAD (once per step, at M times the plan's 1/M price), the forward in F,
what the input gradient needs in I, the rest in W; F, I and W as the overlapped graphs run
them (:mod:`autopp.estimate.exposed_comm`). Invariant:
``F + I + W + hidden + (unshard + reduce_grad) / M == plan.step_time_s + loss`` up to the
casts. Without graphs (:func:`stage_facts_by_rule`) F = I = W = a third of the time.

Memory by category: parameters, gradients (at their pre-reduction size until REDUCE_GRAD),
AdamW moments and fp32 masters, gathered parameters, activations per microbatch in flight
(not the stage input, which lives in the receive buffer; on the last stage plus the loss's
logits), what W keeps from I, buffers, and each action's working memory."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from autopp import tracing
from autopp.graph.weight_gathering import WeightGathering
from autopp.plan.objective import pipeline_objective_s
from autopp.schedules import StageCost
from autopp.sharding.plan import StagePlan, from_strs

PHASES = ("F", "I", "W", "unshard", "reduce_grad")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageFacts:
    """A planned stage's time by runtime piece and its graph-read memory (one device)."""

    forward_s: float
    """F on one microbatch, loss excluded."""
    backward_input_s: float
    """I on one microbatch, loss excluded."""
    backward_weight_s: float
    """W on one microbatch."""
    unshard_s: float
    """One UNSHARD (once per step): parameter casts and gathers."""
    reduce_grad_s: float
    """One REDUCE_GRAD (once per step)."""
    activation_bytes: int | None = None
    """Saved for the backward per microbatch (None: no graphs read)."""
    kept_for_w_bytes: int | None = None
    """Held from the end of I to the end of W per microbatch (None: all activations)."""
    gathered_bytes: int = 0
    """New memory the unshard graphs make (gathered or cast weights), once per step."""
    largest_unit_gathered_bytes: int = 0
    """The most of :attr:`gathered_bytes` one unit (block) makes: what gathering block by
    block holds per block in flight."""
    units: int = 1
    """The stage's units (blocks), over which per-block gathers and reductions spread."""
    workspace_grads: tuple[tuple[str, int], ...] = ()
    """Per compute action kind, the fresh parameter gradients of all units in
    :attr:`workspace` (what reducing block by block does not hold at once)."""
    largest_unit_grads: tuple[tuple[str, int], ...] = ()
    """Per compute action kind, the most fresh parameter gradients one unit makes."""
    checkpoint_bytes: int | None = None
    """Full activation checkpointing per unit: each unit's input, per microbatch."""
    largest_unit_activation_bytes: int = 0
    """The most one unit saves for its backward (recomputed one unit at a time)."""
    workspace: tuple[tuple[str, int], ...] = ()
    """Per compute action kind ("F", "B", "I", "W"), its working memory: the fresh
    parameter gradients of all units plus the largest unit's other transient bytes
    (:func:`autopp.lower.memory.action_workspace_bytes`), and on the last stage the logits'
    gradient in B and I. Empty without graphs."""
    hidden_comm_s: float = 0.0
    """Communication per microbatch that F, I and W run under their compute (not in their
    times; :mod:`autopp.estimate.exposed_comm`). 0 without graphs or without overlap."""
    loss_bytes: int = 0
    """Last stage: what its loss keeps per microbatch until the backward
    (:func:`autopp.sharding.cost.loss.cross_entropy_kept_bytes`); 0 for other stages and
    without graphs."""
    from_graphs: bool = False
    """Whether the split and memory were read off the graphs (else the rule)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Per-step state of a stage on one device, bytes."""

    parameters: int
    gradients: int
    """After REDUCE_GRAD (sharded as the parameters)."""
    unreduced_gradients: int
    """Accumulated over the step's microbatches before REDUCE_GRAD."""
    optimizer: int


def state_bytes(plan: StagePlan, param_dtypes: Mapping[str, torch.dtype]) -> StateBytes:
    """Parameters, gradients and AdamW state of ``plan`` on one device (see module doc).

    ``param_dtypes``: FQN -> the stored parameter's dtype (the stage module's, on meta)."""
    unreduced_in: dict[str, int] = {}
    fqns = {p.fqn for p in plan.params}
    for c in plan.collectives:
        if c.node in fqns:  # a gradient redistributed into its parameter's placement
            unreduced_in[c.node] = max(unreduced_in.get(c.node, 0), c.bytes)
    params = grads = unreduced = opt = 0
    for p in plan.params:
        dtype = param_dtypes[p.fqn]
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = p.local_bytes // itemsize
        params += p.local_bytes
        grads += p.local_bytes
        unreduced += max(p.local_bytes, unreduced_in.get(p.fqn, 0))
        opt += numel * (8 + (4 if itemsize < 4 else 0))
    return StateBytes(parameters=params, gradients=grads, unreduced_gradients=unreduced,
                      optimizer=opt)


def stage_cost(facts: StageFacts, state: StateBytes, *, loss_s: float = 0.0,
               p2p_bytes: int = 0, gathering: WeightGathering = WeightGathering(),
               buffer_bytes: int = 0, collectives_ahead: bool = True,
               overlap: bool = True) -> StageCost:
    """The simulator's :class:`StageCost` of a stage (``loss_s``: its loss, last stage;
    ``gathering``: when its weights are gathered and its gradients reduced
    (:class:`~autopp.graph.weight_gathering.WeightGathering` prices both: per block, the
    gathers join F and I, the reductions W, and the stage holds a few blocks' gathered
    weights and reduced gradients; ``overlap``: the graphs overlap them);
    ``collectives_ahead``: UNSHARD and REDUCE_GRAD run in the background, as the graph
    runtime runs them with overlap on (``StageGraphs.collectives_ahead``);
    ``buffer_bytes``: its registered buffers,
    :func:`autopp.schedules.memory_terms.module_buffer_bytes`). The activations include
    what the loss keeps (``facts.loss_bytes``)."""
    forward_s, backward_input_s, backward_weight_s, unshard_s, reduce_grad_s = gathering.priced(
        forward_s=facts.forward_s, backward_input_s=facts.backward_input_s,
        backward_weight_s=facts.backward_weight_s, unshard_s=facts.unshard_s,
        reduce_grad_s=facts.reduce_grad_s, units=facts.units, overlap=overlap)
    work = gathering.workspace(dict(facts.workspace), dict(facts.workspace_grads),
                               dict(facts.largest_unit_grads))
    return StageCost(
        forward_s=forward_s + loss_s / 2,
        backward_input_s=backward_input_s + loss_s / 2,
        backward_weight_s=backward_weight_s,
        unshard_s=unshard_s,
        collectives_ahead=collectives_ahead,
        reduce_grad_s=reduce_grad_s,
        activation_bytes_per_microbatch=(facts.activation_bytes or 0) + facts.loss_bytes,
        activation_bytes_kept_for_w=facts.kept_for_w_bytes,
        p2p_bytes_per_microbatch=p2p_bytes,
        param_bytes=state.parameters,
        grad_bytes=state.gradients,
        unreduced_grad_bytes=gathering.unreduced_grad_bytes(state.gradients,
                                                            state.unreduced_gradients),
        optimizer_bytes=state.optimizer,
        gathered_param_bytes=gathering.gathered_bytes(facts.gathered_bytes,
                                                      facts.largest_unit_gathered_bytes),
        buffer_bytes=buffer_bytes,
        forward_workspace_bytes=work.get("F", 0),
        backward_workspace_bytes=work.get("B", 0),
        backward_input_workspace_bytes=work.get("I", 0),
        backward_weight_workspace_bytes=work.get("W", 0),
    )


def full_checkpointing_cost(cost: StageCost, facts: StageFacts) -> StageCost:
    """``cost`` with full activation checkpointing per unit (see module doc): a microbatch
    keeps the units' inputs and what the loss keeps; I (or B) recomputes the forward first
    (the loss is not recomputed); what W reads stays as it was."""
    kept = facts.checkpoint_bytes if facts.checkpoint_bytes is not None else 0
    return replace(cost, activation_bytes_per_microbatch=kept + facts.loss_bytes,
                   backward_input_s=cost.backward_input_s + facts.forward_s,
                   backward_s=None if cost.backward_s is None else
                   cost.backward_s + facts.forward_s)


# ---- time split by rule (no graphs) --------------------------------------------------------


def facts_in_thirds(per_microbatch_s: float, *, recompute_s: float = 0.0,
                    **memory_and_once_per_step: Any) -> StageFacts:
    """Facts of a stage whose split into runtime pieces is not read off graphs: F = I = W =
    a third of the per-microbatch time without recomputation, and I re-runs the recomputed
    forward (``recompute_s``). The other fields (UNSHARD, REDUCE_GRAD, memory) as given."""
    f, i, w = StageCost.thirds(per_microbatch_s, recompute_s)
    return StageFacts(forward_s=f, backward_input_s=i, backward_weight_s=w,
                      **memory_and_once_per_step)


def stage_facts_by_rule(plan: StagePlan, n_microbatches: int) -> StageFacts:
    """:func:`facts_in_thirds` of the plan's per-microbatch time; UNSHARD and REDUCE_GRAD
    from the collectives the plan runs in them (:meth:`StagePlan.once_per_step_s`). No
    memory from graphs."""
    gather, reduce = plan.once_per_step_s()
    per_unshard, per_reduce = plan.once_factors(n_microbatches)
    return facts_in_thirds(plan.step_time_s - reduce - gather,
                           unshard_s=gather * per_unshard,
                           reduce_grad_s=reduce * per_reduce, units=len(plan.blocks))


# ---- time split and memory from the graphs -------------------------------------------------


def _phase_of_nodes(joint) -> dict[fx.Node, str]:
    """Each node of a unit's joint graph -> "unshard", "F", "I" or "W" (see module doc)."""
    from autopp.graph.walk import closure, param_only_nodes

    gm = joint.gm
    param_only = param_only_nodes(gm, set(joint.params.values()))
    tangents = set(joint.tangents.values())
    backward: set[fx.Node] = set()
    for n in gm.graph.nodes:  # topological order
        if n in tangents or (n.op == "call_function"
                             and any(a in backward for a in n.all_input_nodes)):
            backward.add(n)
    for_input = closure(list(joint.input_grads.values()), within=backward)
    phase = {}
    for n in gm.graph.nodes:
        if n in param_only:
            phase[n] = "unshard"
        elif n in backward:
            phase[n] = "I" if n in for_input else "W"
        else:
            phase[n] = "F"
    return phase


def _unit_phase_times(joint, unit, bplan, plan: StagePlan, costs, n_microbatches: int,
                      *, overlap: bool = True) -> tuple[dict[str, float], float]:
    """Seconds of one unit by phase (once-per-step phases at their whole price), and the
    communication per microbatch that F, I and W hide under compute; ``costs``: the
    planner's CostModel for the plan's profile and mesh. F, I and W are each the span of
    their compute and collectives as the overlapped graphs run them
    (:func:`autopp.estimate.exposed_comm.piece_time`; ``overlap=False``: the sum)."""
    import operator

    from autopp.estimate.exposed_comm import Transfer, piece_time
    from autopp.sharding.options.strategies import NodeStrategy, Option, _tensor_args, tensor_vals

    phase = _phase_of_nodes(joint)
    out = dict.fromkeys(PHASES, 0.0)
    by_name = {n.name: n for n in joint.gm.graph.nodes}
    compute: dict[fx.Node, float] = {}
    for name, outs, ins in bplan.nodes:
        node = by_name[name]
        if (node.op != "call_function" or node.target is operator.getitem
                or not tensor_vals(node) or not _tensor_args(node)):
            continue
        ns = NodeStrategy(node, "op", [(a, 0) for a in _tensor_args(node)])
        opt = Option(tuple(None if o is None else from_strs(o) for o in outs),
                     tuple(from_strs(i) for i in ins))
        compute[node] = costs.compute_time(ns, opt)
        if phase[node] == "unshard":
            out["unshard"] += compute[node]
    # consumers and producers as the plan names them (planner._node_labels)
    label = {n.name: unit.stage_fqn(f) for f, n in [*joint.params.items(), *joint.buffers.items()]}
    label.update({n.name: f"input{i}" for i, n in joint.inputs.items()})
    label.update({n.name: f"output{i}" for i, n in joint.tangents.items()})
    node_of = {label.get(n.name, n.name): n for n in joint.gm.graph.nodes}
    fqns = {p.fqn for p in plan.params}
    transfers: dict[str, list[Transfer]] = {"F": [], "I": [], "W": []}
    per_unshard, per_reduce = plan.once_factors(n_microbatches)  # to one whole gather / reduce
    for c in plan.collectives:
        if c.block != bplan.prefix:
            continue
        if c.node in fqns:
            out["reduce_grad"] += c.time_s * per_reduce
            continue
        producer = node_of.get(c.producer)
        if producer is not None and phase.get(producer) == "unshard":
            out["unshard"] += c.time_s * per_unshard
            continue
        if c.node.startswith("output") and c.node not in by_name:
            where, consumer = "F", None  # the unit's output into its planned output placement
        elif c.node.startswith("input") and c.node not in by_name:
            where, consumer = "I", None  # the input gradient into the input's placement
        else:
            consumer = node_of.get(c.node)
            where = phase.get(consumer, "F")
            if where not in transfers:
                out[where] += c.time_s
                continue
        transfers[where].append(Transfer(producer, consumer, c.time_s))
    hidden = 0.0
    for where, items in transfers.items():
        order = [n for n in joint.gm.graph.nodes if phase.get(n) == where]
        reads = {n: n.all_input_nodes for n in order}  # other phases' values: ready at 0
        # recomputation: the backward-input piece re-runs the forward values it recomputes
        lead = getattr(bplan, "recompute_s", 0.0) if where == "I" else 0.0
        piece = piece_time(order, compute, reads, items, overlap=overlap, lead_s=lead)
        out[where] += piece.span_s
        hidden += piece.hidden_comm_s
    return out, hidden


def _input_bytes(gm: fx.GraphModule) -> int:
    """Bytes of a graph's tensor inputs."""
    total = 0
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        if isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total


@dataclass(frozen=True, slots=True)
class _UnitFacts:
    """One unit plan's share of :class:`StageFacts`, and its output (the next unit's input)."""

    times: Mapping[str, float]
    hidden_comm_s: float
    saved: int
    saved_inputs: int
    """Of ``saved``, the unit's inputs saved as they are (or views of them)."""
    kept_for_w: int
    gathered: int
    input_bytes: int
    output: tuple[tuple[int, ...], torch.dtype]
    workspace: Mapping[str, tuple[int, int]]


def _unit_facts(joint, unit, bplan, plan: StagePlan, mesh, costs, n_microbatches: int,
                overlap: bool = True) -> _UnitFacts:
    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.lower.memory import action_workspace_bytes, saved_bytes, unsharded_bytes

    from autopp._compat.graph import lazy_graph_modules
    from autopp._compat.sharding import shard_to_shard_as_on
    from autopp.profiles.lookup import get_profile

    # lowered as the plan's devices run it (a GPU target's all-to-alls, not gloo's gathers);
    # the graphs are only read here, never run: their Python code is not generated
    with lazy_graph_modules():
        with shard_to_shard_as_on(get_profile(plan.profile).device_type):
            local = lower_joint(joint, bplan, mesh)
        graphs = split_local(local, recompute=plan.recompute or "none", overlap=overlap)
    saved = saved_bytes(graphs)
    w = graphs.backward_weight_graph
    x = joint.inputs[0].meta["val"] if 0 in joint.inputs else None
    x_bytes = 0 if x is None else costs.local_bytes(x, from_strs(bplan.input_placements))
    out = joint.outputs[0].meta["val"]
    times, hidden = _unit_phase_times(joint, unit, bplan, plan, costs, n_microbatches,
                                      overlap=overlap)
    return _UnitFacts(
        times=times, hidden_comm_s=hidden,
        saved=saved, saved_inputs=saved - saved_bytes(graphs, include_inputs=False),
        kept_for_w=saved if w is None else _input_bytes(w),
        gathered=unsharded_bytes(graphs),
        input_bytes=int(x_bytes),
        output=(tuple(out.shape), out.dtype),
        workspace=action_workspace_bytes(graphs),
    )


def stage_facts(module: nn.Module, plan: StagePlan, mesh: Any, example_inputs: tuple[Any, ...],
                n_microbatches: int, *, memo: dict | None = None,
                overlap: bool = True) -> StageFacts:
    """Time by runtime piece and memory of the planned stage ``module`` (on meta) on one
    device of ``mesh`` (fake process groups work). Each distinct unit plan is traced and
    lowered once; ``memo`` (any dict, e.g. one per dry run) carries them across stages.
    ``overlap``: the graphs issue collectives early and wait at first use
    (:attr:`autopp.plan.PlannerOptions.overlap_collectives`), so F, I and W are priced by
    their exposed communication (:mod:`autopp.estimate.exposed_comm`)."""
    from autopp.sharding.cost.model import CostModel
    from autopp.tracing.precision import maybe_cast
    from autopp.profiles.lookup import get_profile
    from autopp.tracing.cache import plainest_by, traced_unit
    from autopp.lower.apply import check_planned_graph, units_of_plan

    keyword = plan.keyword_examples()
    flat, by_name = units_of_plan(module, plan, mesh, example_inputs[0], keyword)
    memo = {} if memo is None else memo
    costs = CostModel(get_profile(plan.profile), tuple(plan.mesh_shape), plan.tf32)
    x = example_inputs[0]
    traced: dict[str, Any] = {}
    times = dict.fromkeys(PHASES, 0.0)
    acts = kept_w = gathered = ckpt = largest = largest_gathered = 0
    hidden = 0.0
    grads_made: dict[str, int] = {}
    largest_grads: dict[str, int] = {}
    transient: dict[str, int] = {}
    # each signature traced on its plainest unit: the key a trace made while planning has
    plain = plainest_by((b.signature, by_name[b.prefix].module) for b in plan.blocks)
    for index, bplan in enumerate(plan.blocks):  # as autopp.lower.apply.planned_units walks them
        key = (bplan.signature, bplan.nodes, plan.profile, plan.tf32, tuple(plan.mesh_shape),
               plan.param_dtype, n_microbatches, plan.recompute, plan.trace_settings, overlap,
               plan.keyword_inputs)
        if key not in memo:  # identical blocks with one plan: traced and lowered once
            unit = by_name[bplan.prefix]
            if bplan.signature not in traced:
                with tracing.settings(plan.trace_settings):  # as the stage was planned
                    traced[bplan.signature] = traced_unit(
                        plain[bplan.signature], example_inputs if flat else (x, *keyword.values()),
                        param_dtype=plan.param_dtype,
                        prepare=lambda m: maybe_cast(m, plan.param_dtype),
                        differentiable=None if flat else 1)
            joint = traced[bplan.signature]
            check_planned_graph(joint, bplan)
            with tracing.settings(plan.trace_settings):  # priced as planned (MoE routing)
                memo[key] = _unit_facts(joint, unit, bplan, plan, mesh, costs, n_microbatches,
                                        overlap)
        f = memo[key]
        for k, v in f.times.items():
            times[k] += v
        hidden += f.hidden_comm_s
        # the stage's own input, where its first unit saves it, is already held: in torch's
        # receive buffer (or the caller's microbatch on the first stage)
        acts += f.saved - (f.saved_inputs if index == 0 else 0)
        kept_w += f.kept_for_w
        gathered += f.gathered
        largest_gathered = max(largest_gathered, f.gathered)
        ckpt += f.input_bytes
        largest = max(largest, f.saved)
        for kind, (g, t) in f.workspace.items():
            grads_made[kind] = grads_made.get(kind, 0) + g
            largest_grads[kind] = max(largest_grads.get(kind, 0), g)
            transient[kind] = max(transient.get(kind, 0), t)
        x = torch.empty(f.output[0], dtype=f.output[1], device="meta")
    loss = 0
    if plan.loss is not None and x.is_floating_point() and x.ndim >= 2:
        # the last stage: x is its logits (dp-global), in the plan's output placement
        from autopp.sharding.cost.loss import cross_entropy_kept_bytes

        local = int(costs.local_bytes(x, from_strs(plan.output_placements)))
        loss = cross_entropy_kept_bytes(local // x.element_size(), x.element_size())
        for kind in ("B", "I"):  # the loss's gradient of the logits, which they read
            if kind in transient:
                transient[kind] += local
    work = tuple((k, grads_made[k] + transient[k]) for k in sorted(transient))
    return StageFacts(
        forward_s=times["F"], backward_input_s=times["I"], backward_weight_s=times["W"],
        unshard_s=times["unshard"], reduce_grad_s=times["reduce_grad"],
        activation_bytes=acts, kept_for_w_bytes=kept_w, gathered_bytes=gathered,
        largest_unit_gathered_bytes=largest_gathered, units=len(plan.blocks),
        workspace_grads=tuple(sorted(grads_made.items())),
        largest_unit_grads=tuple(sorted(largest_grads.items())),
        checkpoint_bytes=ckpt, largest_unit_activation_bytes=largest, from_graphs=True,
        loss_bytes=loss, workspace=work, hidden_comm_s=hidden,
    )


def param_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """FQN -> stored dtype of each parameter of ``module``."""
    return {n: p.dtype for n, p in module.named_parameters()}


def contended_step_s(critical_s: float, mean_busy_s: float, profile: Any, world: int) -> float:
    """The step of a pipeline from its simulated critical path and its ranks' mean busy time.

    On devices it is the critical path. On a measured CPU profile whose ranks share the
    machine's cores (``shared_cores``: more ranks than cores), rates were measured with every
    rank busy, so a rank idle in a bubble gives its cores to the others: the step is the
    larger of the machine's total work (the mean busy time) and the critical path at the
    uncontended rate (× cores / ranks)."""
    from autopp.profiles.lookup import get_profile

    cores = get_profile(profile).shared_cores
    if not cores:
        return critical_s
    return max(mean_busy_s, critical_s * min(1.0, cores / world))


def simulated_step_s(sim: Any, profile: Any, world: int) -> float:
    """A simulation's step, contended where the profile's ranks share cores
    (:func:`contended_step_s`)."""
    busy = [r.busy_s for r in sim.ranks]
    return contended_step_s(sim.step_time_s, sum(busy) / max(len(busy), 1), profile, world)


def pipeline_estimates(sim: Any, stage_times: list[float], stage_ids_per_rank: Any,
                       n_microbatches: int, profile: Any, memory_reserve: float, world: int
                       ) -> Any:
    """A pipeline's :class:`~autopp.plan.value.PipelineEstimates` from its simulation:
    the step (:func:`simulated_step_s`), the bubble, Alpa's closed formula over the stage
    times (the sum plus (M - 1) × the busiest rank's), and each rank's peak memory."""
    from dataclasses import asdict

    from autopp.plan.value import PipelineEstimates

    rank_of = {s: r for r, ids in enumerate(stage_ids_per_rank) for s in ids}
    rank_of = [rank_of[s] for s in range(len(stage_times))]
    return PipelineEstimates(
        step_time_s=simulated_step_s(sim, profile, world), bubble_fraction=sim.bubble_fraction,
        alpa_time_s=pipeline_objective_s(stage_times, n_microbatches, rank_of),
        stage_time_s=tuple(stage_times), peak_bytes=tuple(r.peak_bytes for r in sim.ranks),
        memory_at_peak=tuple(tuple(asdict(r.memory_at_peak).items()) for r in sim.ranks),
        usable_bytes=usable_bytes(profile, memory_reserve),
    )


def usable_bytes(profile: Any, reserve: float) -> float:
    """Device memory left for the categories the simulator counts: the profile's memory
    minus ``reserve`` (a fraction, for allocator fragmentation and what is not modelled:
    each action's working memory, sent tensors held to the step's end)."""
    from autopp.profiles.lookup import get_profile

    if not 0 <= reserve < 1 or not math.isfinite(reserve):
        raise ValueError(f"memory reserve {reserve!r} must be a fraction in [0, 1)")
    return get_profile(profile).memory_bytes * (1 - reserve)
