"""Activation memory of a planned stage, read off its lowered graphs (exact, per device).

The forward graph of a lowered stage or unit (:mod:`autopp.lower.local_graphs`) returns, after
its outputs, the values its backward needs; their bytes are what one microbatch holds on a
device from its forward until its backward. Parameters, buffers and the unshard graph's
outputs (gathered parameters, held once per stage for the step, see
:func:`unsharded_bytes`) are not counted. A pipeline holds this once per microbatch in
flight on the stage.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from autopp.graph.walk import closure, is_view
from autopp.graph import StageGraphs
from autopp.ops import attention_blockwise as blockwise


def saved_bytes(graphs: StageGraphs, *, include_inputs: bool = True) -> int:
    """Bytes the forward of ``graphs`` saves for the backward, on this device, excluding
    parameters and buffers. ``include_inputs=False`` also leaves out the stage's inputs
    the forward saves as they are or as views (no new memory when already held, e.g. in a
    pipeline's receive buffers: what "full" recomputation saves of a middle stage)."""
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
        if not include_inputs and not _owns_storage(node):  # an input or a view of one
            continue
        total += val.numel() * val.element_size()
    return total


def _owns_storage(node: Any) -> bool:
    """Whether an unshard output is new memory (a gather, cast or copy on its way from the
    parameter), not a view of the parameter itself."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if not is_view(n):
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
        seen = closure([out])
        gathered = any("all_gather" in str(n.target) for n in seen)
        roots = {fqn_of[n] for n in seen if n in fqn_of}
        if gathered:
            for fqn in roots:
                counts[fqn] = counts.get(fqn, 0) + 1
    return counts


def _returns_alias(node: Any) -> bool:
    """Whether ``node``'s output is (a view of, or written into) one of its inputs, not new
    memory: views, in-place and out= ops, getitem, and collectives' waits."""
    target = node.target
    if "wait_tensor" in str(target):
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return is_view(node)
    return bool(getattr(target, "is_view", False)) or any(
        r.alias_info is not None for r in schema.returns)


def op_scratch_bytes(node: Any) -> int:
    """Bytes an op holds internally while it runs, beyond its inputs and outputs, where that
    is large and known: autopp's attention (:mod:`autopp.ops.attention`). Its forward
    repeats keys and values per query head under grouped-query attention; its backward
    (the fused kernel's, from the saved output and log-sum-exp: the forward is not run
    again) repeats them too, and the kernel's q, k and v gradients (at the query's head
    count) exist before they are summed per group and copied into the op's outputs. No
    seq x seq tensor: the kernels are fused; capped scores (``softcap``) hold the blockwise
    path's blocks (:func:`autopp.ops.attention_blockwise.scratch_bytes`)."""
    target = str(node.target)
    backward = "autopp.sdpa_backward" in target
    if not backward and "autopp.sdpa." not in target:
        return 0
    tensors = node.args[1:4] if backward else node.args[0:3]
    q, k, v = (a.meta.get("val") for a in tensors)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return 0
    groups = q.shape[1] // k.shape[1]
    repeated = 0 if groups == 1 else groups * sum(t.numel() * t.element_size() for t in (k, v))
    softcap = node.args[10 if backward else 7] if len(node.args) > (10 if backward else 7) \
        else node.kwargs.get("softcap", 0.0)
    if softcap:  # capped scores: the blockwise path's fp32 blocks
        return repeated + blockwise.scratch_bytes(q.shape, k.shape, backward=backward)
    if not backward:
        return repeated
    grads = q.numel() * q.element_size() + groups * sum(
        t.numel() * t.element_size() for t in (k, v))
    return repeated + grads


def graph_peak_bytes(gm: Any) -> int:
    """Peak bytes of the tensors ``gm`` allocates while it runs, replayed in node order as
    fx's generated code runs it (a value is freed after its last reader; views, in-place
    ops and collective waits share their input's memory). Its inputs are not counted (the
    caller holds them); its outputs are, and stay to the end. Kernels' internal scratch
    memory is not seen, except autopp's attention's (:func:`op_scratch_bytes`)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    for n in gm.graph.output_node().all_input_nodes:
        last[n] = len(nodes)
    size: list[int] = []                 # buffer -> bytes
    refs: list[int] = []                 # buffer -> nodes holding it
    held: dict[Any, list[int | None]] = {}  # node -> its buffers (None: not a tensor)
    dies: dict[int, list[Any]] = {}
    live = peak = 0
    for i, node in enumerate(nodes):
        if node.op == "call_function":
            if node.target is operator.getitem:
                parent, k = held.get(node.args[0], []), node.args[1]
                bufs = [parent[k]] if isinstance(k, int) and k < len(parent) else []
            elif _returns_alias(node):
                first = node.all_input_nodes[0] if node.all_input_nodes else None
                bufs = list(held.get(first, []))
            else:
                vals = node.meta.get("val")
                peak = max(peak, live + op_scratch_bytes(node))
                bufs = []
                for v in vals if isinstance(vals, (tuple, list)) else (vals,):
                    if isinstance(v, torch.Tensor):
                        size.append(v.numel() * v.element_size())
                        refs.append(0)
                        live += size[-1]
                        bufs.append(len(size) - 1)
                    else:
                        bufs.append(None)
                peak = max(peak, live)
            held[node] = bufs
            for b in {b for b in bufs if b is not None}:
                refs[b] += 1
            dies.setdefault(last[node], []).append(node)
        for dead in dies.pop(i, ()):
            for b in {b for b in held[dead] if b is not None}:
                refs[b] -= 1
                if refs[b] == 0:
                    live -= size[b]
    return peak


def _outputs_bytes(gm: Any, first: int = 0, count: int | None = None) -> int:
    """Bytes of ``gm``'s tensor outputs ``first .. first + count`` that the graph allocates
    (each once; not its inputs or views of them, which :func:`graph_peak_bytes` does not
    count either)."""
    outs = list(gm.graph.output_node().args[0])
    outs = outs[first:] if count is None else outs[first:first + count]
    seen, total = set(), 0
    for n in outs:
        val = n.meta.get("val") if hasattr(n, "meta") else None
        if isinstance(val, torch.Tensor) and n not in seen and _owns_storage(n):
            seen.add(n)
            total += val.numel() * val.element_size()
    return total


def action_workspace_bytes(graphs: StageGraphs) -> dict[str, tuple[int, int]]:
    """Per compute action ("F", and "B" or "I" / "W"), what its graph allocates while it runs
    beyond what the simulator already holds: ``(gradients, transient)``, where
    ``gradients`` are the fresh parameter gradients it returns (added into the step's
    accumulators after it; they add up over a stage's units) and ``transient`` the rest of
    its :func:`graph_peak_bytes` (intermediates, and the input gradients it sends), less
    what it keeps: F's outputs (its saved values are the activations, its output is the
    stage's), I's values kept for W."""
    sig = graphs.convention.signature
    out: dict[str, tuple[int, int]] = {}
    fw = graphs.forward_graph
    out["F"] = (0, max(0, graph_peak_bytes(fw) - _outputs_bytes(fw)))
    b = graphs.full_backward_graph
    if b is not None:
        g = _outputs_bytes(b, 0, sig.num_param_grads)
        out["B"] = (g, max(0, graph_peak_bytes(b) - g))
    i, w = graphs.backward_input_graph, graphs.backward_weight_graph
    if i is not None:
        out["I"] = (0, max(0, graph_peak_bytes(i) - _outputs_bytes(i, sig.num_input_grads)))
    if w is not None:
        g = _outputs_bytes(w)
        out["W"] = (g, max(0, graph_peak_bytes(w) - g))
    return out
