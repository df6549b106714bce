"""Peel a joint graph's parameter-only work (casts, views, all-gathers) into an unshard graph.

A parameter reaches the compute through work that depends on it alone (a mixed-precision
cast, views, all-gathers). That work is the same for every microbatch, so it belongs in
UNSHARD, once per step; the forward then reads the gathered values as inputs, and every
microbatch's saved values only reference them: one gathered copy per stage.

Why not torchtitan's SimpleFSDP split: it expects one all-gather chain per parameter, while
a planned graph may gather a parameter in two placements (``w`` and ``t(w)``) or use it both
gathered and sharded. This pass takes every node whose inputs are parameters only: the
*unshard graph* returns the frontier (the parameter-only values other nodes use) and the
*rest* takes the frontier in place of the parameters. A parameter-only graph output stays in
the rest."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopp.graph.walk import closure, param_only_nodes
from autopp.graph.convention import JointSignature


@dataclasses.dataclass(frozen=True, slots=True)
class PeeledParams:
    """The result of :func:`peel_param_work`."""

    unshard: fx.GraphModule
    """Parameters used (in :attr:`param_indices` order) -> the frontier values."""
    rest: fx.GraphModule
    """The joint graph with inputs ``frontier, buffers, user_inputs, output_grads``."""
    param_indices: tuple[int, ...]
    """Which flat parameters the unshard graph takes, in its input order."""
    num_frontier: int
    """Number of unshard outputs (leading inputs of :attr:`rest`)."""
    num_forward_frontier: int
    """The first this many unshard outputs are read by the forward; the others only by the
    backward."""
    frontier_is_param: tuple[bool, ...]
    """Per frontier value: whether it is a parameter itself (no work, no extra memory)."""


def peel_param_work(gm: fx.GraphModule, signature: JointSignature) -> PeeledParams:
    """Split ``gm`` (laid out as ``signature`` says) into an unshard graph and the rest.

    ``gm`` is not modified. See the module docstring for what is peeled.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    params = placeholders[: signature.num_params]
    param_set = set(params)
    (output,) = gm.graph.find_nodes(op="output")
    out_args = set(output.all_input_nodes)

    only = param_only_nodes(gm, param_set)
    peel = {n for n in gm.graph.nodes if n.op == "call_function" and n in only
            and n not in out_args}
    # keep the set closed under inputs, and tuple-valued nodes with all their users
    changed = True
    while changed:
        changed = False
        for n in list(peel):
            bad_input = any(i not in peel and i not in param_set for i in n.all_input_nodes)
            bad_tuple = _is_tuple(n) and any(u not in peel for u in n.users)
            if bad_input or bad_tuple:
                peel.discard(n)
                changed = True

    def used_outside(n: fx.Node) -> bool:
        return any(u not in peel for u in n.users)

    frontier = [n for n in gm.graph.nodes
                if (n in param_set or n in peel) and used_outside(n)]
    # the forward's frontier first: values a forward output depends on
    fwd_closure = closure(_outputs(output)[: signature.num_outputs])
    in_fwd = [f for f in frontier
              if any(u not in peel and u.op != "output" and u in fwd_closure for u in f.users)]
    frontier = in_fwd + [f for f in frontier if f not in in_fwd]

    # unshard graph: the params it needs -> frontier values
    needed = closure(frontier)
    used_params = [p for p in params if p in needed]
    ug = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in used_params:
        env[p] = ug.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in gm.graph.nodes:
        if n in peel and n in needed:
            env[n] = ug.node_copy(n, lambda a: env[a])
    ug.output(tuple(env[f] for f in frontier))
    unshard = fx.GraphModule(gm, ug)

    # rest: frontier placeholders first, then the other inputs, then the non-peeled nodes
    rg = fx.Graph()
    renv: dict[fx.Node, fx.Node] = {}
    for i, f in enumerate(frontier):
        ph = rg.placeholder(f"unsharded_{i}_{f.name}")
        ph.meta = dict(f.meta)
        renv[f] = ph
    for ph in placeholders[signature.num_params:]:
        renv[ph] = rg.node_copy(ph)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n in peel:
            continue
        renv[n] = rg.node_copy(n, lambda a: renv[a])
    rg.node_copy(output, lambda a: renv[a])
    rest = fx.GraphModule(gm, rg)
    return PeeledParams(
        unshard=unshard,
        rest=rest,
        param_indices=tuple(params.index(p) for p in used_params),
        num_frontier=len(frontier),
        num_forward_frontier=len(in_fwd),
        frontier_is_param=tuple(f in param_set for f in frontier),
    )


def _outputs(output: fx.Node) -> tuple:
    vals = output.args[0]
    return tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)


def _is_tuple(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (tuple, list))
