"""Communication overlap in a graph: issue each collective early, wait for it late.

As traced, each functional collective is followed at once by its ``wait_tensor``.
:func:`overlap_collectives` moves each collective up to just after the last node it depends
on and each wait down to just before the first node that reads its value, so communication
runs under compute where collectives are asynchronous (NCCL; gloo's work threads).

Invariants: only collectives and waits move, so values are unchanged; the order stays
topological (``graph.lint()``); all collectives keep their issue order relative to each
other (every rank must issue a group's collectives alike); nothing crosses a barrier (an op
that mutates an argument, a side-effecting call, a module or method call), so no collective
reads a buffer before a write it should see.

The estimates price what this order hides (:mod:`autopp.estimate.exposed_comm`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.fx as fx

_NAMESPACE = "_c10d_functional"


def is_collective(node: fx.Node) -> bool:
    """A functional collective (not its wait)."""
    return (node.op == "call_function"
            and getattr(node.target, "namespace", None) == _NAMESPACE
            and not is_wait(node))


def is_wait(node: fx.Node) -> bool:
    """A functional collective's ``wait_tensor``."""
    return (node.op == "call_function"
            and getattr(node.target, "namespace", None) == _NAMESPACE
            and getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
            == "wait_tensor")


def is_barrier(node: fx.Node) -> bool:
    """A node nothing is moved across: one that mutates an argument or has another effect
    the pass cannot see (module and method calls, side-effecting functions)."""
    if node.op in ("call_module", "call_method"):
        return True
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return False
    return node.is_impure(impure_random=False)  # a mutable schema, or an effect torch knows


@dataclass(frozen=True, slots=True)
class OverlapReport:
    """What :func:`overlap_collectives` moved in one graph."""

    collectives: int
    """Collectives in the graph."""
    hoisted: int
    """Collectives issued earlier than traced."""
    sunk: int
    """Waits moved later than traced."""


def overlap_collectives(gm: fx.GraphModule) -> OverlapReport:
    """Reorder ``gm`` in place (see the module docstring): collectives as early as their
    inputs allow, waits just before the first use of their value. Recompiles ``gm`` when
    it changed; returns what moved."""
    graph = gm.graph
    hoisted = _hoist_collectives(graph)
    sunk = _sink_waits(graph)
    if hoisted or sunk:
        graph.lint()
        gm.recompile()
    return OverlapReport(collectives=sum(map(is_collective, graph.nodes)),
                         hoisted=hoisted, sunk=sunk)


def _hoist_collectives(graph: fx.Graph) -> int:
    """Move each collective, in graph order, to just after the latest of its inputs, the
    previous collective and the previous barrier."""
    nodes = list(graph.nodes)
    pos: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    # a moved collective sits just after its target: between two whole positions, later
    # than whatever was moved there before (collectives keep their order)
    step = 1.0 / (len(nodes) + 1)
    moved = 0
    anchor: fx.Node | None = None  # the last node no later collective may pass
    for node in nodes:
        if node.op == "placeholder":  # the inputs stay first
            anchor = node
        if is_collective(node):
            after = [*node.all_input_nodes, *([anchor] if anchor is not None else [])]
            target = max(after, key=pos.__getitem__, default=None)
            if target is not None and target.next is not node:
                target.append(node)  # moves the node to just after ``target``
                pos[node] = pos[target] + step
                moved += 1
            anchor = node
        elif is_barrier(node):
            anchor = node
    return moved


def _sink_waits(graph: fx.Graph) -> int:
    """Move each wait to just before its first user, stopping at the first barrier (or
    the output) after it."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    next_stop = [len(nodes) - 1] * len(nodes)  # index of the first barrier / output at or after i
    for i in range(len(nodes) - 1, -1, -1):
        last = nodes[i].op == "output" or is_barrier(nodes[i])
        next_stop[i] = i if last or i == len(nodes) - 1 else next_stop[i + 1]
    moved = 0
    for wait in [n for n in nodes if is_wait(n)]:
        if not wait.users:
            continue
        i = pos[wait]
        stop = nodes[min(min(pos[u] for u in wait.users), next_stop[i])]
        if stop is not wait.next:
            stop.prepend(wait)  # moves the wait to just before ``stop``
            moved += 1
    return moved


def defer_output_waits(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """A copy of ``gm`` that leaves its returned collectives in flight, and which outputs
    those are.

    Each output that is a collective's ``wait_tensor`` read by nothing else in the graph is
    returned as the collective's own (not yet waited) result; the caller must
    ``wait_tensor`` each of the returned positions before it reads it (the graph runtime
    does, just before the first action that reads them: :mod:`autopp.graph.stage`). A wait
    that something in the graph reads (a cast of a gathered weight) stays. ``gm`` is not
    modified; with none to defer, ``(gm, ())``."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        return gm, ()
    outs, pending = list(outs), []
    for i, node in enumerate(outs):
        if (isinstance(node, fx.Node) and is_wait(node) and set(node.users) == {output}
                and outs.count(node) == 1):
            outs[i] = node.args[0]
            pending.append(i)
    if not pending:
        return gm, ()
    output.args = (type(output.args[0])(outs),)
    for i in pending:
        waits = [u for u in outs[i].users if is_wait(u) and not u.users]
        for w in waits:
            graph.erase_node(w)
    graph.lint()
    return fx.GraphModule(gm, graph), tuple(pending)


def overlap_stage_graphs(graphs) -> dict[str, OverlapReport]:
    """:func:`overlap_collectives` on every graph of ``graphs`` (an
    :class:`autopp.graph.StageGraphs`: forward, backward pieces, unshard, reduce-grad), in
    place; what moved, by graph name."""
    return {name: overlap_collectives(gm) for name, gm in graphs.graphs().items()}


def describe_overlap(graphs, on: bool, compiled: bool = False) -> str:
    """One ``describe()`` line: whether ``graphs``' collectives are issued early and waited
    at first use, how many there are, and where UNSHARD's and REDUCE_GRAD's are waited
    (``compiled``: the stage's graphs run through Inductor, whose unshard and reduce-grad
    callables wait in place)."""
    n = sum(is_collective(node) for gm in graphs.graphs().values() for node in gm.graph.nodes)
    if not on:
        return (f"overlap off (overlap_collectives=False): each of its {n} collectives is "
                "waited right after it is issued")
    ahead = ("; UNSHARD's gathers and REDUCE_GRAD's reductions wait in place in the compiled "
             "graphs (the estimates assume them left in flight)" if compiled else
             "; UNSHARD's gathers are left in flight to the stage's next action, "
             "REDUCE_GRAD's reductions to the step's end")
    return (f"overlap on (overlap_collectives=True): its {n} collectives are issued as soon "
            "as their inputs exist and waited just before first use (the sharding ILP prices "
            f"a piece's collectives in full){ahead}")
