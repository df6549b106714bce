"""Read the :class:`JointSignature` of a graph from AOTAutograd's joint export.

``torch._functorch.aot_autograd.aot_export_joint_with_descriptors`` lays a joint graph out
as autopp expects (params, buffers, user inputs, tangents -> outputs, param grads, input
grads) and tags every input and output with a descriptor; this reads the counts from them.
"""

from __future__ import annotations

import copy

import torch.fx as fx

from autopp._compat import graph as _compat
from autopp.graph.convention import JointSignature


def from_aot_joint(gm: fx.GraphModule) -> tuple[fx.GraphModule, JointSignature]:
    """A flat copy of an ``aot_export_joint_with_descriptors`` graph, and its signature.

    The copy takes its inputs flat (``gm(*params, *buffers, *user_inputs, *tangents)``),
    returns a flat tuple, and drops the ``None`` gradient slots AOTAutograd keeps for
    buffers, so it has the layout :func:`split_joint_graph` expects.
    """
    flat = copy.deepcopy(gm)
    (out,) = flat.graph.find_nodes(op="output")
    values = _compat.tree_leaves(out.args[0], is_leaf=lambda v: v is None)
    descs = _compat.tree_leaves(out.meta.get("desc", []), is_leaf=lambda v: v is None)
    if len(values) != len(descs):
        raise ValueError("joint-graph outputs and their AOT descriptors differ in number")
    keep = [(v, d) for v, d in zip(values, descs) if not (v is None and d is None)]
    out.args = (tuple(v for v, _ in keep),)
    out.meta["desc"] = [d for _, d in keep]
    _compat.use_flat_codegen(flat)
    return flat, signature_from_aot_descriptors(flat)


def signature_from_aot_descriptors(gm: fx.GraphModule) -> JointSignature:
    """The layout of an ``aot_export_joint_with_descriptors`` joint graph (see
    :func:`from_aot_joint`, which also drops buffers' ``None`` gradient slots).

    A graph without tangent inputs is taken as a last stage (its output is the loss).

    Raises:
        ValueError: a placeholder or output has no AOT descriptor, or the groups are not in
            the order params, buffers, user inputs, tangents / outputs, grads.
    """
    ins, outs = _compat.aot_descriptor_kinds(gm)
    order = {"ParamAOTInput": 0, "BufferAOTInput": 1, "PlainAOTInput": 2, "TangentAOTInput": 3}
    if any(k not in order for k in ins):
        raise ValueError(
            f"unsupported joint-graph input descriptors {sorted(set(ins) - set(order))}: expected "
            "a graph from aot_export_joint_with_descriptors with plain (non-subclass) inputs; "
            "otherwise describe its layout with a JointSignature by hand."
        )
    ranks = [order[k] for k in ins]
    if ranks != sorted(ranks):
        raise ValueError("joint-graph inputs must be params, buffers, user inputs, tangents in order")
    n_fwd = sum(1 for kind, _ in outs if kind != "GradAOTOutput")
    if any(kind != "GradAOTOutput" for kind, _ in outs[n_fwd:]) or n_fwd == 0:
        raise ValueError("joint-graph outputs must be the forward outputs, then the gradients")
    grads = [of for _, of in outs[n_fwd:]]
    n_user = ins.count("PlainAOTInput")
    plain_grads = [of for of in grads if of == "PlainAOTInput"]
    n_tangents = ins.count("TangentAOTInput")
    return JointSignature(
        num_params=ins.count("ParamAOTInput"),
        num_buffers=ins.count("BufferAOTInput"),
        num_user_inputs=n_user,
        num_output_grads=n_tangents,
        num_outputs=n_fwd,
        num_param_grads=sum(1 for of in grads if of == "ParamAOTInput"),
        # AOTAutograd returns one grad slot per user input, in input order
        input_grad_indices=tuple(range(len(plain_grads))),
        is_last=n_tangents == 0,
    )
