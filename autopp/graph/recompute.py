"""Activation recomputation: the backward pieces recompute forward values instead of saving them.

``split_joint_graph(..., recompute=...)`` rewrites the joint graph before partitioning so the
backward reads recomputed copies of the forward values it needs; torchtitan's partitioner
then saves only what the copies start from. Nodes are tagged with torch's
``CheckpointPolicy``. ``"selective"`` saves matmul and attention outputs and recomputes cheap
ops; ``"full"`` saves only the stage inputs.

Always saved (``MUST_SAVE``): random ops (a recomputed mask would differ); collectives other
than activation all-gathers (a reduction's output is no larger than its input; an
activation all-gather's is group-size times larger, so it is re-gathered from the saved
shard, as Megatron-LM does); parameter-only values through a collective; in-place writes
that cannot be made out-of-place; higher-order ops. Under the I/W split a value I needs is
recomputed once in I and handed to W; one only W needs is recomputed in W. Nothing is
recomputed twice."""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Literal, get_args

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from autopp._compat import graph as _compat
from autopp.graph.walk import closure
from autopp.graph.convention import JointSignature

Recompute = Literal["none", "selective", "full"]
"""What the backward recomputes instead of saving (see the module docstring)."""

RECOMPUTE_POLICIES: tuple[str, ...] = get_args(Recompute)

_COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"})
_MATMUL_OPS = frozenset({
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
    torch.ops.aten.addbmm, torch.ops.aten.matmul, torch.ops.aten.linear,
    torch.ops.aten.convolution, torch.ops.aten._convolution, torch.ops.aten._scaled_mm,
})


_SAVED_BY_SELECTIVE: set = set()


def save_under_selective(*packets) -> None:
    """Count these op packets as compute-intensive: ``"selective"`` saves their outputs
    rather than re-running them (an op library's own attention or matmul ops, e.g.
    ``autopp::sdpa``, which torch's list does not know)."""
    _SAVED_BY_SELECTIVE.update(packets)


def check_recompute(recompute: str) -> None:
    """Raise ``ValueError`` unless ``recompute`` is one of :data:`RECOMPUTE_POLICIES`."""
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_POLICIES}, got {recompute!r}")


def recompute_in_backward(gm: fx.GraphModule, signature: JointSignature,
                          recompute: Recompute) -> fx.GraphModule:
    """A copy of the joint graph ``gm`` whose backward recomputes, per ``recompute``, the
    forward values it reads (``gm`` itself when ``recompute="none"``).

    Recomputed copies are named ``<forward node>_recomputed`` and carry
    ``meta["recomputed_from"]``; forward nodes carry their ``meta["recompute"]`` policy.
    """
    check_recompute(recompute)
    if recompute == "none":
        return gm
    gm = copy.deepcopy(gm)
    graph = gm.graph
    pinned = _functionalize_or_pin_mutations(graph)
    (out,) = graph.find_nodes(op="output")
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    fwd = closure(outs[: signature.num_outputs])
    bwd_only = closure(outs[signature.num_outputs:]) - fwd
    save = _saved_nodes(graph, signature, fwd, pinned, selective=recompute == "selective")
    for node in fwd:
        if node.op == "call_function":
            node.meta["recompute"] = (CheckpointPolicy.MUST_SAVE if node in save
                                      else CheckpointPolicy.PREFER_RECOMPUTE)

    clones: dict[fx.Node, fx.Node] = {}

    def recomputed(node: fx.Node) -> fx.Node:
        """The backward's copy of forward ``node`` (inserted at the current point)."""
        if node.op != "call_function" or node in save:
            return node
        if node not in clones:
            args, kwargs = fx.map_arg((node.args, node.kwargs), recomputed)
            clone = graph.create_node("call_function", node.target, args, kwargs,
                                      name=f"{node.name}_recomputed", type_expr=node.type)
            clone.meta = {**node.meta, "recomputed_from": node.name}
            clone.meta.pop("recompute", None)
            clones[node] = clone
        return clones[node]

    for node in list(graph.nodes):
        if node not in bwd_only:
            continue
        for inp in node.all_input_nodes:
            if inp in fwd:
                with graph.inserting_before(node):
                    node.replace_input_with(inp, recomputed(inp))
    graph.lint()
    gm.recompile()
    return gm


@dataclasses.dataclass(frozen=True, slots=True)
class RecomputeSets:
    """What :func:`recompute_in_backward` (and so ``split_joint_graph``) does with each
    forward node of a joint graph under one policy, by node name (see
    :func:`recompute_sets`)."""

    recompute: str
    """The policy: ``"none"``, ``"selective"`` or ``"full"``."""
    must_save: frozenset[str]
    """Forward ``call_function`` nodes tagged ``MUST_SAVE``: saved whenever the backward
    needs them (directly or to recompute another node). Under ``"none"``: every forward
    ``call_function`` node."""
    saved: frozenset[str]
    """The forward values the backward reads as they are: the placeholders and ``must_save``
    nodes it needs (parameters and buffers included: callers drop what they hold anyway)."""
    recomputed: frozenset[str]
    """The forward nodes the backward recomputes (empty under ``"none"``)."""


def recompute_sets(gm: fx.GraphModule, signature: JointSignature,
                   recompute: Recompute) -> RecomputeSets:
    """Which forward nodes of the joint graph ``gm`` are saved for the backward and which
    are recomputed under ``recompute``: the classification :func:`recompute_in_backward`
    applies (same helpers, run on a copy; ``gm`` is not modified), for cost models that
    price a policy without splitting. Names are ``gm``'s node names (an in-place op that
    the rewrite makes out-of-place appears under its new name)."""
    check_recompute(recompute)
    gm = copy.deepcopy(gm)
    graph = gm.graph
    pinned = _functionalize_or_pin_mutations(graph) if recompute != "none" else set()
    (out,) = graph.find_nodes(op="output")
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    fwd = closure(outs[: signature.num_outputs])
    bwd_only = closure(outs[signature.num_outputs:]) - fwd
    if recompute == "none":
        save = {n for n in fwd if n.op == "call_function"}
    else:
        save = _saved_nodes(graph, signature, fwd, pinned, selective=recompute == "selective")
    saved: set[fx.Node] = set()
    recomputed: set[fx.Node] = set()
    stack = [i for n in bwd_only for i in n.all_input_nodes if i in fwd]
    while stack:  # the walk of recompute_in_backward's ``recomputed``
        node = stack.pop()
        if node in saved or node in recomputed:
            continue
        if node.op != "call_function" or node in save:
            saved.add(node)
        else:
            recomputed.add(node)
            stack += node.all_input_nodes
    return RecomputeSets(
        recompute=recompute,
        must_save=frozenset(n.name for n in save),
        saved=frozenset(n.name for n in saved),
        recomputed=frozenset(n.name for n in recomputed),
    )


def _saved_nodes(graph: fx.Graph, signature: JointSignature, fwd: set[fx.Node],
                 pinned: set[fx.Node], *, selective: bool) -> set[fx.Node]:
    """The forward nodes the backward reads as they are (saved), not recomputed."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    state = set(placeholders[: signature.num_state_inputs])
    state |= set(graph.find_nodes(op="get_attr"))
    gathered: set[fx.Node] = set()  # parameter / buffer work through a collective
    save: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        ins = node.all_input_nodes
        if ins and all(i in state for i in ins):
            state.add(node)
            if _is_collective(node) or any(i in gathered for i in ins):
                gathered.add(node)
        if node not in fwd:
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            if parent in save or parent.op != "call_function":
                save.add(node)
            continue
        if (node in gathered or node in pinned or _never_recomputed(node)
                or (selective and _is_matmul_like(node))):
            save.add(node)
    return save


def _is_collective(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES


_REGATHERED = frozenset({"all_gather_into_tensor", "all_gather_into_tensor_out"})


def _is_regathered(node: fx.Node) -> bool:
    """An all-gather, or the wait of one: recomputed (gathered again) in the backward."""
    name = node.target.overloadpacket.__name__
    if name == "wait_tensor" and node.args and isinstance(node.args[0], fx.Node):
        src = node.args[0]
        return _is_collective(src) and src.target.overloadpacket.__name__ in _REGATHERED
    return name in _REGATHERED


def _never_recomputed(node: fx.Node) -> bool:
    """Random ops, collectives other than all-gathers of activations (parameter chains
    are kept by ``_saved_nodes``), and calls of anything but a torch operator."""
    target = node.target
    if not _compat.is_op_overload(target):
        return True
    if _is_collective(node):
        return not _is_regathered(node)
    if torch.Tag.nondeterministic_seeded in target.tags:
        return not _no_dropout(node)
    return False


def _no_dropout(node: fx.Node) -> bool:
    """An attention op with ``dropout_p`` 0 (tagged seeded, but deterministic)."""
    names = [a.name for a in _compat.op_schema(node.target).arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return p == 0.0


def _is_matmul_like(node: fx.Node) -> bool:
    target = node.target
    packet = target.overloadpacket
    if packet in _MATMUL_OPS or packet in _SAVED_BY_SELECTIVE or \
            packet in _compat.compute_intensive_ops():
        return True
    name = packet.__name__
    if "backward" in name:
        return False
    return ("scaled_dot_product" in name and "attention" in name) or name.endswith(
        "_attention_forward")


def _functionalize_or_pin_mutations(graph: fx.Graph) -> set[fx.Node]:
    """Rewrite in-place ops on fresh intermediates (not a view, no view of it, no read of it
    after the write) to their out-of-place form; return the nodes the other in-place writes
    pin, which must not be recomputed: the write, the written value and its views, and
    every node that reads one of them before the write."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not _compat.is_mutation_node(node):
            continue
        base = node.args[0] if node.args else None
        form = _compat.functional_form(node.target, node.args, node.kwargs)
        if (form is not None and isinstance(base, fx.Node) and base.op == "call_function"
                and not _is_view(base) and not _compat.is_mutation_node(base)
                and all(u is node or (order[u] < order[node] and not _is_view(u))
                        for u in base.users)):
            with graph.inserting_before(node):
                new = graph.call_function(*form)
            new.meta = dict(node.meta)
            order[new] = order[node]
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    pinned: set[fx.Node] = set()
    for node in graph.nodes:
        if _compat.is_mutation_node(node):
            base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else node
            group = _alias_group(base) | {node}
            pinned |= group
            pinned |= {u for g in group for u in g.users if order[u] < order[node]}
    return pinned


def _is_view(node: fx.Node) -> bool:
    return bool(getattr(node.target, "is_view", False))


def _alias_group(node: fx.Node) -> set[fx.Node]:
    """``node``'s base (through views) and every view of it."""
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    group, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in group:
            group.add(n)
            stack += [u for u in n.users if _is_view(u) or u.target is operator.getitem]
    return group
