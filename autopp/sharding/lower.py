"""Lower a planned joint graph to a local graph with explicit collectives (second version).

:mod:`autopp.sharding.interpret` runs a :class:`BlockPlan` by interpreting the joint graph on
DTensors, node by node. Here the same interpreter (:class:`~autopp.sharding.interpret.GraphRunner`)
is traced once with ``make_fx`` (fake tensors, this rank's local shapes): DTensor's
redistributions become ``_c10d_functional`` collectives on plain tensors and every op runs on
the local shard, so the result is one flat aten graph, identical in values to the
interpreter, that :func:`autopp.graph.split_joint_graph` can cut into the forward /
backward / backward-input / backward-weight callables of a pipeline schedule.

The lowered graph's calling convention (see :class:`autopp.graph.JointSignature`)::

    inputs : params, buffers, user_inputs, tangents      (local shards, planned placements)
    outputs: forward_outputs (in their tangent's placement),
             param_grads (in their parameter's placement),
             input_grads (in their input's placement)

Local shapes depend on the rank when a dimension does not divide evenly, so the graph is
traced per rank (each rank lowers its own).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from autopp.graph import JointSignature, StageGraphs, split_joint_graph
from autopp.sharding import _torch_private as tp
from autopp.sharding.interpret import GraphRunner, redistribute_to
from autopp.sharding.plan import BlockPlan, to_strs
from autopp.sharding.trace import JointGraph

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


def _device(mesh: Any) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


def lower_joint(joint: JointGraph, bplan: BlockPlan, mesh: Any) -> LocalJoint:
    """Trace ``bplan``'s execution of ``joint`` on ``mesh`` into a local joint graph.

    The traced function wraps its local inputs with ``DTensor.from_local`` in their planned
    placements, runs the plan exactly as :mod:`autopp.sharding.interpret` does
    (one pass over the whole joint graph: what the interpreter's forward and recomputing
    backward compute together), and returns local tensors: forward outputs in their
    tangent's placement, parameter gradients in their parameter's placement and input
    gradients in their input's placement. A parameter without a gradient gets zeros.

    Args:
        joint: the unit's joint graph, traced on meta with global shapes (the one planned).
        bplan: the unit's plan (``StagePlan.blocks[i]``).
        mesh: the (sub-)mesh the plan is for; must be initialised on this rank.

    Raises:
        ValueError: a graph input is planned ``Partial``, the mesh does not match the plan,
            or the joint has no tangent (a last stage; not supported here).
    """
    runner = GraphRunner(joint, bplan, mesh, _device(mesh))
    if not joint.tangents:
        raise ValueError("lower_joint needs a joint with output tangents (a non-last unit)")
    inputs = [joint.inputs[i] for i in sorted(joint.inputs)]
    tangents = [joint.tangents[i] for i in sorted(joint.tangents)]
    nodes = [*joint.params.values(), *joint.buffers.values(), *inputs, *tangents]
    placements = [runner.placement(n) for n in nodes]
    for node, pl in zip(nodes, placements):
        if len(pl) != mesh.ndim:
            raise ValueError(f"{node.name} is planned for a {len(pl)}-d mesh, got {mesh.ndim}-d")
        if any(isinstance(p, tp.Partial) for p in pl):
            raise ValueError(f"graph input {node.name} is planned Partial {to_strs(pl)}: inputs "
                             "must be Shard or Replicate")
    vals = [n.meta["val"] for n in nodes]
    shapes = [tp.local_shape(v.shape, mesh, pl) for v, pl in zip(vals, placements)]

    grad_pairs = [(j, joint.grads.get(f)) for f, j in joint.params.items()]
    igrad = [(joint.inputs[i], joint.input_grads[i]) for i in sorted(joint.input_grads)]
    out_targets = [runner.placement(t) for t in tangents]
    outs_in = [joint.outputs[i] for i in sorted(joint.tangents)]
    if len(outs_in) != len(joint.outputs):
        raise ValueError("every forward output needs a tangent to be lowered")

    def step(*local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env: dict[fx.Node, Any] = {
            n: DTensor.from_local(t, mesh, pl, run_check=False, shape=v.shape, stride=v.stride())
            for n, t, pl, v in zip(nodes, local, placements, vals)
        }
        by_node = dict(zip(nodes, local))
        env = runner.run(env, None)
        res: list[torch.Tensor] = []
        for node, pl in zip(outs_in, out_targets):
            res.append(_local(env[node], pl))
        for pnode, g in grad_pairs:
            if g is None or env.get(g) is None:
                res.append(torch.zeros_like(by_node[pnode]))
            else:
                res.append(_local(env[g], runner.placement(pnode)))
        for xnode, g in igrad:
            res.append(_local(env[g], runner.placement(xnode)))
        return tuple(res)

    with FakeTensorMode():  # make_fx traces in the inputs' fake mode: nothing is allocated
        examples = [torch.empty(s, dtype=v.dtype, device=_device(mesh)) for s, v in zip(shapes, vals)]
    decomps = _missing_kernel_decomps(joint.gm, _device(mesh))
    gm = make_fx(step, decomposition_table=decomps, tracing_mode="fake")(*examples)
    _check_local(gm)

    out_pls = [to_strs(p) for p in out_targets]
    out_pls += [to_strs(runner.placement(p)) for p, _ in grad_pairs]
    out_pls += [to_strs(runner.placement(x)) for x, _ in igrad]
    sig = JointSignature(
        num_params=len(joint.params),
        num_buffers=len(joint.buffers),
        num_user_inputs=len(inputs),
        num_output_grads=len(tangents),
        num_outputs=len(outs_in),
        num_param_grads=len(joint.params),
        input_grad_indices=tuple(sorted(joint.inputs).index(i) for i in sorted(joint.input_grads)),
    )
    return LocalJoint(
        gm=gm,
        signature=sig,
        param_fqns=tuple(joint.params),
        buffer_fqns=tuple(joint.buffers),
        input_shapes=tuple(shapes),
        input_placements=tuple(to_strs(p) for p in placements),
        output_placements=tuple(out_pls),
    )


def _missing_kernel_decomps(gm: fx.GraphModule, device: torch.device) -> dict[Any, Any]:
    """Decompositions of the ops in ``gm`` that have no kernel for ``device``.

    The interpreter decomposes them when they raise at run time (e.g. the meta trace picks
    ``_fused_rms_norm_backward``, which has no CPU kernel); fake tensors never raise, so the
    lowered graph decomposes them while tracing.
    """
    table = {}
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not tp.is_op_overload(op) or op in table:
            continue
        if not tp.has_kernel(op, device):
            decomp = tp.decomposition(op)
            if decomp is not None:
                table[op] = decomp
    return table


def _local(value: Any, placements: Sequence[Any]) -> torch.Tensor:
    """``value`` (a DTensor) redistributed to ``placements`` (none Partial), as a local tensor."""
    if any(isinstance(p, tp.Partial) for p in placements):
        raise ValueError(f"graph outputs cannot be returned Partial, planned {to_strs(placements)}")
    out = redistribute_to(value, tuple(placements))
    if isinstance(out, DTensor):
        if tuple(out.placements) != tuple(placements):
            raise AssertionError(f"{out.placements} != {placements}")
        return out.to_local()
    return out


def _check_local(gm: fx.GraphModule) -> None:
    """Raise unless ``gm`` only runs aten ops, ``_c10d_functional`` collectives and getitem
    on plain tensors (no DTensor left in any node's value)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            ns = getattr(node.target, "namespace", None)
            if ns not in ("aten", "_c10d_functional", "autopp"):
                raise AssertionError(f"lowered graph node {node.name} calls {node.target}")
        for v in tp.tree_leaves(node.meta.get("val")):
            if isinstance(v, DTensor):
                raise AssertionError(f"lowered graph node {node.name} still holds a DTensor")


def split_local(
    local: LocalJoint, *, split_weight_grad: bool = True, peel_unshard: bool = False
) -> StageGraphs:
    """Split a lowered joint with :func:`autopp.graph.split_joint_graph` into forward / full
    backward / backward-input / backward-weight / reduce-grad callables on local tensors.

    The gradient reductions at the end of parameter-gradient chains become the reduce-grad
    graph (so ``full_backward`` returns unreduced gradients; call ``reduce_grads``).
    ``peel_unshard`` also moves parameter all-gather chains into an unshard graph
    (torchtitan's SimpleFSDP split); that needs each such parameter to be used only through
    its chain, which a planned graph rarely satisfies (the backward re-gathers ``t(w)`` in
    another placement, so the forward saves ``w`` itself and the split fails). By default
    the parameters are presented to the split as buffers, so no unshard graph is made; the
    returned convention carries the true signature. ``local.gm`` is not modified.
    """
    sig = local.signature
    gm = fx.GraphModule(local.gm, copy.deepcopy(local.gm.graph))  # the split edits in place
    if peel_unshard:
        return split_joint_graph(gm, sig, split_weight_grad=split_weight_grad)
    as_buffers = dataclasses.replace(sig, num_params=0, num_buffers=sig.num_state_inputs)
    graphs = split_joint_graph(gm, as_buffers, split_weight_grad=split_weight_grad)
    graphs.convention = dataclasses.replace(graphs.convention, signature=sig)
    return graphs
