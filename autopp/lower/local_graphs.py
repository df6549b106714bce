"""Lower a planned joint graph to a local graph with explicit collectives.

The plan's interpreter (:class:`~autopp.lower.interpret.GraphRunner`) is traced with
``make_fx`` on fake tensors of this rank's local shapes (once per distinct unit,
:mod:`autopp.lower.stitch`): DTensor's redistributions become ``_c10d_functional``
collectives and every op runs on the local shard, giving one flat aten graph, equal in values
to the interpreter, that :func:`autopp.graph.split_joint_graph` cuts into a schedule's pieces.

Calling convention (:class:`autopp.graph.JointSignature`): inputs params, buffers,
user_inputs, tangents (local shards in planned placements); outputs forward_outputs,
param_grads, input_grads, each in its planned placement. Local shapes depend on the rank
where a dim does not divide evenly, so each rank lowers its own."""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from autopp.graph import JointSignature, Recompute, StageGraphs, split_joint_graph
from autopp.graph.overlap import overlap_stage_graphs
from autopp._compat import sharding as compat
from autopp._compat.graph import graph_module, lazy_graph_modules
from autopp._compat.distributed import FakeTensorMode
from autopp.lower import stitch
from autopp.lower.interpret import GraphRunner
from autopp.sharding.plan import BlockPlan, to_strs
from autopp.tracing.joint import JointGraph

_COLLECTIVE_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


@dataclass(frozen=True, slots=True)
class LocalJoint:
    """A planned unit's joint graph on this rank's local shards, collectives explicit."""

    gm: fx.GraphModule
    """Flat graph: ``params, buffers, user_inputs, tangents`` -> ``outputs, param_grads,
    input_grads``, all plain local tensors."""
    signature: JointSignature
    """Layout of :attr:`gm`, as :func:`autopp.graph.split_joint_graph` expects it."""
    param_fqns: tuple[str, ...]
    """Parameter FQNs (in the traced unit's module) in graph input order."""
    buffer_fqns: tuple[str, ...]
    """Buffer FQNs in graph input order, after the parameters."""
    input_shapes: tuple[tuple[int, ...], ...]
    """Local shape of every graph input, in order."""
    input_placements: tuple[tuple[str, ...], ...]
    """Planned placement of every graph input, in order (as :mod:`plan` strings)."""
    output_placements: tuple[tuple[str, ...], ...]
    """Placement each graph output is returned in, in order."""

    def collective_counts(self) -> dict[str, int]:
        """Number of ``_c10d_functional`` collective nodes by op name (waits excluded)."""
        return collective_counts(self.gm)


def collective_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Count the ``_c10d_functional`` collectives (all-gather, reduce-scatter, ...) in ``gm``."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name.startswith("_c10d_functional.") and any(c in name for c in _COLLECTIVE_NAMES):
            key = name.split(".")[1]
            counts[key] = counts.get(key, 0) + 1
    return counts


def mesh_device(mesh: Any) -> torch.device:
    """This rank's device of ``mesh`` (the current CUDA device on a CUDA mesh)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


def lower_joint(joint: JointGraph, bplan: BlockPlan, mesh: Any) -> LocalJoint:
    """Trace ``bplan``'s execution of ``joint`` on ``mesh`` into a local joint graph.

    The traced function wraps its local inputs with ``DTensor.from_local`` in their planned
    placements, runs the plan as :mod:`autopp.lower.interpret` does (forward and recomputing
    backward in one pass) and returns local tensors: forward outputs in their tangent's
    placement, parameter and input gradients in their own placements (zeros for a parameter
    without a gradient).

    Args:
        joint: the unit's joint graph, traced on meta with global shapes (the one planned).
        bplan: the unit's plan (``StagePlan.blocks[i]``).
        mesh: the (sub-)mesh the plan is for; must be initialised on this rank.

    Raises ValueError when an input is planned ``Partial``, the mesh does not match the plan,
    or the joint has no tangent."""
    runner = GraphRunner(joint, bplan, mesh, mesh_device(mesh))
    if not joint.tangents:
        raise ValueError("lower_joint needs a joint with output tangents (a non-last unit)")
    unit = LoweredUnit(joint, bplan, tuple(joint.params), tuple(joint.buffers))
    return lower_stage([unit], mesh, runner.placement(joint.inputs[0]),
                       runner.placement(joint.tangents[0]))


def _missing_kernel_decomps(gm: fx.GraphModule, device: torch.device) -> dict[Any, Any]:
    """Decompositions of the ops in ``gm`` that have no kernel for ``device``.

    The interpreter decomposes them when they raise at run time (e.g. the meta trace picks
    ``_fused_rms_norm_backward``, which has no CPU kernel); fake tensors never raise, so the
    lowered graph decomposes them while tracing.
    """
    table = {}
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not compat.is_op_overload(op) or op in table:
            continue
        if not compat.has_kernel(op, device):
            decomp = compat.decomposition(op)
            if decomp is not None:
                table[op] = decomp
    return table


def _check_local(gm: fx.GraphModule) -> None:
    """Raise unless ``gm`` only runs aten ops, ``_c10d_functional`` collectives and getitem
    on plain tensors (no DTensor left in any node's value)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            ns = getattr(node.target, "namespace", None)
            if ns not in ("aten", "_c10d_functional", "autopp"):
                raise AssertionError(f"lowered graph node {node.name} calls {node.target}")
        for v in compat.tree_leaves(node.meta.get("val")):
            if isinstance(v, DTensor):
                raise AssertionError(f"lowered graph node {node.name} still holds a DTensor")


def split_local(local: LocalJoint, *, split_weight_grad: bool = True,
                recompute: Recompute = "none", overlap: bool = True) -> StageGraphs:
    """Split a lowered joint with :func:`autopp.graph.split_joint_graph` into unshard / forward /
    full backward / backward-input / backward-weight / reduce-grad callables on local tensors.

    Every parameter-only computation (casts, views, all-gathers, in every placement the plan
    uses a parameter in) becomes the unshard graph (``peel_params=True``), run once per step;
    the gradient reductions become the reduce-grad graph (``full_backward`` returns unreduced
    gradients). ``recompute``: what the backward recomputes (:mod:`autopp.graph.recompute`).
    ``overlap`` (default True): each piece issues collectives early and waits late
    (:func:`autopp.graph.overlap.overlap_collectives`). ``local.gm`` is not modified."""
    # the passes' intermediate graph modules generate no Python code (torch's lazy graph
    # modules): each piece generates its own once, when it first runs
    with lazy_graph_modules():
        gm = graph_module(local.gm, copy.deepcopy(local.gm.graph))  # the split edits in place
        graphs = split_joint_graph(gm, local.signature, split_weight_grad=split_weight_grad,
                                   peel_params=True, recompute=recompute)
        if overlap:
            overlap_stage_graphs(graphs)
    return graphs


@dataclass(frozen=True, slots=True)
class LoweredUnit:
    """One planned unit of a stage, as :func:`lower_stage` chains it."""

    joint: JointGraph
    """The unit's joint graph (traced on meta with global shapes, as planned)."""
    plan: BlockPlan
    """The unit's plan."""
    param_fqns: tuple[str, ...]
    """Stage FQNs of the unit's parameters, in ``joint.params`` order."""
    buffer_fqns: tuple[str, ...]
    """Stage FQNs of the unit's buffers, in ``joint.buffers`` order."""


def lower_stage(units: Sequence[LoweredUnit], mesh: Any, in_placements: tuple,
                out_placements: tuple) -> LocalJoint:
    """Lower a whole planned stage (its units in order) to one local joint graph.

    The graph runs every unit's forward through the plan's interpreter, moving each output to the
    next unit's planned input placement and the last to ``out_placements``, then the units'
    backwards in reverse from the output gradient. Each distinct unit is traced once
    (:mod:`autopp.lower.stitch`); the result is the graph one trace of the whole stage would give,
    op for op.

    Inputs: every unit's parameters, then buffers (units in order), the stage input (in
    ``in_placements``), the keyword inputs (never differentiated), the output gradient. Outputs:
    the stage output, one gradient per parameter (zeros where none) and the input's gradient
    when it is differentiable. Raises ValueError when a parameter, buffer or boundary is planned
    ``Partial`` or a unit has no output tangent."""
    dev = mesh_device(mesh)
    runners = [GraphRunner(u.joint, u.plan, mesh, dev) for u in units]
    n_kw = len(units[0].joint.inputs) - 1
    for k, u in enumerate(units):
        if not u.joint.tangents or len(u.joint.outputs) != 1 or \
                sorted(u.joint.inputs) != list(range(n_kw + 1)):
            raise ValueError("every unit of a stage takes one input (and the same keyword "
                             "inputs) and returns one output with a tangent")
        if k > 0 and 0 not in u.joint.input_grads:
            raise ValueError(f"unit {k} of the stage passes no gradient to the unit before it")
    kw_nodes = [units[0].joint.inputs[i] for i in range(1, n_kw + 1)]
    p_nodes = [(r, n) for u, r in zip(units, runners) for n in u.joint.params.values()]
    b_nodes = [(r, n) for u, r in zip(units, runners) for n in u.joint.buffers.values()]
    p_fqns = [f for u in units for f in u.param_fqns]
    b_fqns = [f for u in units for f in u.buffer_fqns]
    x_node = units[0].joint.inputs[0]
    out_node = units[-1].joint.outputs[0]
    x_pl, out_pl = tuple(in_placements), tuple(out_placements)
    kw_pl = [runners[0].placement(n) for n in kw_nodes]
    placements = [r.placement(n) for r, n in p_nodes + b_nodes] + [x_pl, *kw_pl, out_pl]
    vals = [n.meta["val"] for _, n in p_nodes + b_nodes]
    vals += [x_node.meta["val"], *(n.meta["val"] for n in kw_nodes), out_node.meta["val"]]
    names = p_fqns + b_fqns + ["stage input", *(f"keyword input {i}" for i in range(n_kw)),
                               "stage output gradient"]
    for name, pl in zip(names, placements):
        if len(pl) != mesh.ndim:
            raise ValueError(f"{name} is planned for a {len(pl)}-d mesh, got {mesh.ndim}-d")
        if any(isinstance(p, compat.Partial) for p in pl):
            raise ValueError(f"{name} is planned Partial {to_strs(pl)}: stage inputs must be "
                             "Shard or Replicate")
    shapes = [compat.local_shape(v.shape, mesh, pl) for v, pl in zip(vals, placements)]
    n_p, n_b = len(p_nodes), len(b_nodes)
    has_input_grad = 0 in units[0].joint.input_grads

    with FakeTensorMode() as fake:
        examples = [torch.empty(s, dtype=v.dtype, device=dev) for s, v in zip(shapes, vals)]
    x_end = stitch.End.of(x_node.meta["val"], x_pl)
    out_end = stitch.End.of(out_node.meta["val"], out_pl)
    kw_ends = [stitch.End.of(n.meta["val"], pl) for pl, n in zip(kw_pl, kw_nodes)]
    gm = stitch.stitch_stage(
        [stitch.UnitSpec(u.joint, u.plan, r, _missing_kernel_decomps(u.joint.gm, dev))
         for u, r in zip(units, runners)],
        mesh, fake, examples, n_p=n_p, n_b=n_b, x_end=x_end, kw_ends=kw_ends,
        out_end=out_end, has_input_grad=has_input_grad)
    _check_local(gm)

    pl_strs = [to_strs(p) for p in placements]
    out_pls = [to_strs(out_pl)] + pl_strs[:n_p] + ([to_strs(x_pl)] if has_input_grad else [])
    sig = JointSignature(
        num_params=n_p, num_buffers=n_b, num_user_inputs=1 + n_kw, num_output_grads=1,
        num_outputs=1, num_param_grads=n_p,
        input_grad_indices=(0,) if has_input_grad else (),
    )
    return LocalJoint(
        gm=gm, signature=sig, param_fqns=tuple(p_fqns), buffer_fqns=tuple(b_fqns),
        input_shapes=tuple(shapes), input_placements=tuple(pl_strs),
        output_placements=tuple(out_pls),
    )
