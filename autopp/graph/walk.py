"""Walks over FX graphs that several floors share: a value's ancestors (:func:`closure`) and
the nodes computed from parameters alone (:func:`param_only_nodes`, the work a stage's
UNSHARD runs once per step)."""

from __future__ import annotations

from torch import fx


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
