"""Trace a stage module's joint forward+backward aten graph (meta device, global shapes).

The graph comes from AOTAutograd's joint export: it is functional, its placeholders are the
parameters, buffers, user inputs and output tangents, and its outputs are the forward outputs
followed by the gradients. Descriptors tie each gradient to the parameter it belongs to, which
is what lets the solver make a gradient end in its parameter's placement.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autopp import tracing
from autopp.ops.attention import AttentionAsOneOp
from autopp._compat import sharding as compat


@dataclass(frozen=True, slots=True)
class JointGraph:
    """The joint graph of one module call, with its inputs and outputs named."""

    gm: fx.GraphModule
    """Functional joint graph (fake-tensor ``meta["val"]`` on every node)."""
    params: dict[str, fx.Node]
    """Parameter FQN -> placeholder."""
    buffers: dict[str, fx.Node]
    """Buffer FQN -> placeholder."""
    inputs: dict[int, fx.Node]
    """Index of a user (tensor) input -> placeholder."""
    tangents: dict[int, fx.Node]
    """Index of a forward output -> the placeholder of its tangent."""
    outputs: dict[int, fx.Node]
    """Index of a forward output -> the node producing it."""
    grads: dict[str, fx.Node]
    """Parameter FQN -> the node producing its gradient."""
    input_grads: dict[int, fx.Node]
    """Index of a user input -> the node producing its gradient."""
    placeholders: tuple[fx.Node, ...]
    """All placeholders, in the order the graph takes them."""
    output_descs: tuple[Any, ...]
    """The output node's descriptors, in order."""
    buffer_updates: dict[str, fx.Node] = field(default_factory=dict)
    """Buffer FQN -> the node producing the value the forward writes into it in place (e.g.
    a MoE layer's tokens-per-expert count). The planner keeps it in the buffer's placement;
    the lowered graph copies it into the buffer."""

    @property
    def num_fwd_outputs(self) -> int:
        return len(self.outputs)


def check_on_meta(module: nn.Module, example_inputs: tuple[Any, ...]) -> None:
    """Raise ValueError unless every parameter, buffer and tensor input is on the meta device."""
    off = [n for n, p in module.named_parameters() if p.device.type != "meta"]
    off += [n for n, b in module.named_buffers() if b.device.type != "meta"]
    if off:
        raise ValueError(
            f"the planner needs the module on the meta device (global shapes, no memory); "
            f"{len(off)} parameter(s)/buffer(s) are not, e.g. {off[:3]}; build it under "
            "`with torch.device('meta'):`"
        )
    bad = [
        i
        for i, a in enumerate(example_inputs)
        if isinstance(a, torch.Tensor) and a.device.type != "meta"
    ]
    if bad:
        raise ValueError(
            f"example input(s) {bad} are not on the meta device; pass meta tensors with the "
            "global (unsharded) shapes"
        )


def trace_joint(module: nn.Module, example_inputs: tuple[Any, ...],
                differentiable: int | None = None) -> JointGraph:
    """Trace ``module(*example_inputs)`` forward and backward.

    Floating-point tensor inputs (the first ``differentiable`` of them when given: the others
    are keyword inputs, never differentiated) are made to require grad so their gradients
    (what a previous pipeline stage or block needs) appear in the graph. Non-tensor inputs
    (e.g. ``None`` masks) are passed through.
    """
    check_on_meta(module, example_inputs)
    n = len(example_inputs) if differentiable is None else differentiable
    args = tuple(
        a.detach().requires_grad_(a.is_floating_point() and i < n)
        if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(example_inputs)
    )
    gm = compat.export_joint(module, args, [AttentionAsOneOp(), tracing.on_meta()])

    params: dict[str, fx.Node] = {}
    buffers: dict[str, fx.Node] = {}
    inputs: dict[int, fx.Node] = {}
    tangents: dict[int, fx.Node] = {}
    placeholders = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        placeholders.append(node)
        desc = node.meta.get("desc")
        if compat.is_param_input(desc):
            params[compat.desc_target(desc)] = node
        elif compat.is_buffer_input(desc):
            buffers[compat.desc_target(desc)] = node
        elif compat.is_plain_input(desc):
            inputs[compat.desc_index(desc)] = node
        elif compat.is_tangent_input(desc):
            tangents[compat.desc_index(desc)] = node
        else:
            raise NotImplementedError(f"unsupported graph input {node.name}: {desc!r}")

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    descs = tuple(out_node.meta.get("desc") or ())
    outputs: dict[int, fx.Node] = {}
    grads: dict[str, fx.Node] = {}
    input_grads: dict[int, fx.Node] = {}
    buffer_updates: dict[str, fx.Node] = {}
    for arg, desc in zip(out_node.args[0], descs):
        if arg is None:
            continue
        if compat.buffer_mutated(desc) is not None:
            buffer_updates[compat.buffer_mutated(desc)] = arg
        elif compat.is_plain_output(desc):
            outputs[compat.desc_index(desc)] = arg
        elif compat.is_grad_output(desc):
            target = compat.desc_target(desc)
            if target is not None:
                grads[target] = arg
            else:
                idx = compat.grad_of_plain_index(desc)
                if idx is not None:
                    input_grads[idx] = arg
        else:
            raise NotImplementedError(f"unsupported graph output {arg}: {desc!r}")
    return JointGraph(
        gm=gm,
        params=params,
        buffers=buffers,
        inputs=inputs,
        tangents=tangents,
        outputs=outputs,
        grads=grads,
        input_grads=input_grads,
        placeholders=tuple(placeholders),
        output_descs=descs,
        buffer_updates=buffer_updates,
    )


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each traced graph module's signature, computed once: a plan of identical blocks reads it
once per block. Joint graphs are never modified once traced
(:mod:`autopp.tracing.cache` shares them on that rule)."""


def graph_signature(joint: JointGraph) -> str:
    """A structural key: two joint graphs with equal keys can share one plan.

    Node names, op targets, argument structure and shapes/dtypes; parameter FQNs are left out
    (block ``layers.0`` and ``layers.1`` of a stack share the key). Parameter order is kept.
    """
    hit = _SIGNATURES.get(joint.gm)
    if hit is None:
        hit = _SIGNATURES[joint.gm] = _signature(joint)
    return hit


def _signature(joint: JointGraph) -> str:
    import hashlib

    h = hashlib.sha256()
    for node in joint.gm.graph.nodes:
        val = node.meta.get("val")
        shape = (
            (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else type(val)
        )
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
        h.update(f"{node.op}|{node.name}|{node.target}|{args}|{shape}\n".encode())
    return h.hexdigest()
