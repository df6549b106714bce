"""Activation memory of a planned stage, read off its lowered graphs (exact, per device).

The forward graph of a lowered stage or unit (:mod:`autopp.sharding.lower`) returns, after
its outputs, the values its backward needs; their bytes are what one microbatch holds on a
device from its forward until its backward. Parameters, buffers and the unshard graph's
outputs (gathered parameters, held once per stage for the step, see
:func:`unsharded_bytes`) are not counted. A pipeline holds this once per microbatch in
flight on the stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopp.graph import StageGraphs
from autopp.sharding.plan import StagePlan


def saved_bytes(graphs: StageGraphs) -> int:
    """Bytes the forward of ``graphs`` saves for the backward, on this device, excluding
    parameters and buffers."""
    conv = graphs.convention
    sig = conv.signature
    fw = graphs.forward_graph
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    # forward inputs: unsharded params, then flat inputs (params, buffers, user inputs) by index
    state = set(placeholders[: conv.num_unsharded_params])
    for ph, flat_index in zip(placeholders[conv.num_unsharded_params :], conv.forward_input_indices):
        if flat_index < sig.num_params + sig.num_buffers:
            state.add(ph)
    outs = fw.graph.output_node().args[0]
    total = 0
    for node in outs[sig.num_outputs : sig.num_outputs + conv.num_saved_for_backward]:
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if node in state or not isinstance(val, torch.Tensor):
            continue
        total += val.numel() * val.element_size()
    return total


_VIEW_OPS = frozenset({
    "aten.t.default", "aten.transpose.int", "aten.view.default", "aten._unsafe_view.default",
    "aten.permute.default", "aten.slice.Tensor", "aten.select.int", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.alias.default", "aten.expand.default",
    "aten.detach.default", "aten.unsqueeze.default", "aten.squeeze.dim",
    "aten.as_strided.default", "<built-in function getitem>",
})


def _owns_storage(node: Any) -> bool:
    """Whether an unshard output is new memory (a gather, cast or copy on its way from the
    parameter), not a view of the parameter itself."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if str(n.target) not in _VIEW_OPS:
            return True
        stack += n.all_input_nodes
    return False


def unsharded_bytes(graphs: StageGraphs) -> int:
    """Bytes of the unshard graph's outputs that are new memory (gathered or cast weights;
    not the parameters or views of them): what a stage holds once, from UNSHARD until its
    last use in the step."""
    ug = graphs.unshard_graph
    if ug is None:
        return 0
    total = 0
    for node in ug.graph.output_node().args[0]:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not _owns_storage(node):
            continue
        total += val.numel() * val.element_size()
    return total


def activation_bytes_per_microbatch(
    module: nn.Module, plan: StagePlan, mesh: Any, example_inputs: tuple[Any, ...]
) -> int:
    """Bytes one microbatch keeps on this device of ``mesh`` between the forward and the
    backward of the planned stage ``module`` (meta is fine; fake process groups work)."""
    from autopp.sharding.apply import planned_units

    per_plan: dict[tuple, int] = {}
    total = 0
    for bplan, _unit, _joint, lowered in planned_units(module, plan, mesh, example_inputs,
                                                     lower=True):
        key = (bplan.signature, bplan.nodes)
        if key not in per_plan:
            per_plan[key] = saved_bytes(lowered[1])
        total += per_plan[key]
    return total


def gathered_values_per_param(graphs: StageGraphs, param_fqns: tuple[str, ...]) -> dict[str, int]:
    """For each parameter the unshard graph all-gathers: how many distinct gathered values it
    makes of it (1: gathered once and used as it is, or transposed locally; 2 or more: the
    plan uses the weight in several placements, e.g. ``w`` for the forward and ``t(w)``
    gathered on another dim for the backward, and each is gathered once per step)."""
    ug = graphs.unshard_graph
    if ug is None:
        return {}
    placeholders = list(ug.graph.find_nodes(op="placeholder"))
    fqn_of = {ph: param_fqns[i] for ph, i in zip(placeholders, graphs.convention.unshard_param_indices)}
    counts: dict[str, int] = {}
    for out in ug.graph.output_node().args[0]:
        seen, stack, gathered, roots = set(), [out], False, set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            gathered |= "all_gather" in str(n.target)
            if n in fqn_of:
                roots.add(fqn_of[n])
            stack += n.all_input_nodes
        if gathered:
            for fqn in roots:
                counts[fqn] = counts.get(fqn, 0) + 1
    return counts
