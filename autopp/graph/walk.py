"""Walks over FX graphs that several floors share: a value's ancestors (:func:`closure`),
the nodes computed from parameters alone (:func:`param_only_nodes`, the work a stage's
UNSHARD runs once per step), and which nodes are views of their input (:func:`is_view`)."""

from __future__ import annotations

import operator

import torch
from torch import fx


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s output is a view of its input (the same storage, no data moved):
    an op torch's schema marks as a view (``OpOverload.is_view``: view, slice, select,
    split, transpose, permute, expand, detach, ...), ``_unsafe_view`` (what ``reshape``
    becomes in a traced graph, unmarked in its schema), or a ``getitem`` of a multi-output
    op. The one rule for the planner's compute costs and memory row, the lowered graphs'
    memory count and the reduce-grad walk."""
    if node.op != "call_function":
        return False
    t = node.target
    return (t is operator.getitem or t is torch.ops.aten._unsafe_view.default
            or bool(getattr(t, "is_view", False)))


def closure(values: object, within: set[fx.Node] | None = None) -> set[fx.Node]:
    """The FX nodes among ``values`` and everything they are computed from (the ancestor
    walk); ``within``: walk only through these nodes (the others are neither kept nor
    followed)."""
    seen: set[fx.Node] = set()
    stack = [v for v in values if isinstance(v, fx.Node)]  # type: ignore[union-attr]
    while stack:
        n = stack.pop()
        if n not in seen and (within is None or n in within):
            seen.add(n)
            stack += n.all_input_nodes
    return seen


def param_only_nodes(gm: fx.GraphModule, params: set[fx.Node]) -> set[fx.Node]:
    """Nodes computed from parameters alone (the parameters, their casts and views): their
    redistributions run in the stage's UNSHARD, once per step (:mod:`autopp.graph.peel`
    peels them into the unshard graph; the planner and the estimates price them there)."""
    only: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node in params:
                only.add(node)
        elif node.op == "call_function":
            ins = node.all_input_nodes
            if ins and all(i in only for i in ins):
                only.add(node)
    return only
