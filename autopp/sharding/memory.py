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


def unsharded_bytes(graphs: StageGraphs) -> int:
    """Bytes of the unshard graph's outputs that are not parameters themselves: what a stage
    holds once, from UNSHARD until its last use in the step (gathered or cast parameters)."""
    ug = graphs.unshard_graph
    if ug is None:
        return 0
    params = set(ug.graph.find_nodes(op="placeholder"))
    total = 0
    for node in ug.graph.output_node().args[0]:
        val = node.meta.get("val")
        if node in params or not isinstance(val, torch.Tensor):
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
