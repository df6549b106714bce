"""Where a parameter gradient's reduction starts: the cut between a stage's backward and its
REDUCE_GRAD, so what the step accumulates across microbatches is the gradient as the
backward computed it.

torchtitan's pass cuts at the earliest reduce-scatter / all-reduce of a gradient's tail,
right for SimpleFSDP graphs (cast, reduce, wait). For a gradient redistributed into a nested
sharding (dp and tp on one tensor dim) DTensor all-gathers over tp first, so that cut would
accumulate the tp-gathered gradient, tp times the bytes the planner counted.
:func:`reduce_grad_split_point` moves the cut back over the data-movement nodes (collectives,
waits, views, slices, splits, cats) that only the reduction reads, to the compute node that
made the gradient; REDUCE_GRAD then runs the whole redistribution once per step.
Invariant: the cut moves only where it makes the accumulator no larger."""

from __future__ import annotations

import torch
from torch import fx

from autopp.graph.overlap import is_collective, is_wait
from autopp.graph.walk import is_view

_COPY_OPS = frozenset({torch.ops.aten.cat.default, torch.ops.aten.clone.default})
"""Ops that copy their inputs' values into new memory without arithmetic (views aside)."""


def _moves_data(node: fx.Node) -> bool:
    """Whether ``node`` only moves or regroups its inputs' values (no arithmetic beyond a
    collective's reduction)."""
    if node.op != "call_function":
        return False
    return is_collective(node) or is_wait(node) or is_view(node) or node.target in _COPY_OPS


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else -1


def reduce_grad_split_point(grad_output: object, torchtitan_point: fx.Node | None
                            ) -> fx.Node | None:
    """The node whose value the step accumulates for ``grad_output`` (a backward output:
    a parameter's reduced gradient), REDUCE_GRAD computing the rest; ``torchtitan_point``:
    torchtitan's cut (None: the gradient has no reduction, nothing is peeled).

    Walks from ``torchtitan_point`` back through data-movement nodes to the compute nodes
    they start from. The cut moves to that node when there is exactly one, the nodes
    between are read by nothing outside the walk (so REDUCE_GRAD can take them all), at
    least one of them is a collective, and the node's value is no larger than
    ``torchtitan_point``'s. Otherwise torchtitan's cut stands."""
    if not isinstance(torchtitan_point, fx.Node) or not _moves_data(torchtitan_point):
        return torchtitan_point
    region: set[fx.Node] = set()
    roots: set[fx.Node] = set()
    stack = [torchtitan_point]
    while stack:
        n = stack.pop()
        if n in region or n in roots:
            continue
        if _moves_data(n):
            region.add(n)
            stack += n.all_input_nodes
        else:
            roots.add(n)
    if len(roots) != 1 or not any(is_collective(n) for n in region):
        return torchtitan_point
    (root,) = roots
    for n in region - {torchtitan_point}:
        if any(u not in region for u in n.users):
            return torchtitan_point
    if not 0 <= _bytes(root) <= _bytes(torchtitan_point):
        return torchtitan_point
    return root
