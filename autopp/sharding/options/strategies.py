"""Candidate placements of every node of a joint graph, from DTensor's own sharding rules.

Each node gets a list of :class:`Option` (each output's placement and each argument's
required one). Graph inputs get every even placement of their shape; ops ask DTensor's
registry (``op_strategy_funcs`` or a single-dim rule expanded to the mesh); ``getitem``
follows its producer. An op with no rule, or whose rule fails, is replicated, recorded in
:attr:`Strategies.fallbacks` and warned about once (``PlannerOptions(strict=True)`` refuses
it). ``_StridedShard`` and uneven options are pruned (batch on dp ahead of anything on tp
keeps the layouts the planner needs plain), and DTensor's own redistribute-cost estimates are
off while enumerating: costs.py prices every edge."""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass, field

import torch
from torch import fx

from autopp._compat import sharding as compat
from autopp.sharding.options import expert_dispatch  # noqa: F401  (registers its op hooks)
from autopp.sharding.options import op_hooks
from autopp.sharding.options.option import Option, Placements, local_shape, tensor_vals
from autopp.tracing.joint import JointGraph

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()
"""Ops already warned about in this process (one warning per op and reason)."""


@dataclass(slots=True)
class NodeStrategy:
    node: fx.Node
    kind: str
    """"param", "buffer", "input", "tangent", "op", "getitem", "const"."""
    edges: list[tuple[fx.Node, int]]
    """(producer, producer output index) of each tensor argument."""
    options: list[Option] = field(default_factory=list)
    fallback: bool = False
    follows: dict[Option, tuple[Placements, ...]] | None = None
    """For single-input ops asked once per producer placement: the producer placements each
    option was derived from. The solver only links those (a view is never fed a tensor that
    was redistributed for it; the redistribution happens before or after instead)."""


@dataclass(slots=True)
class Strategies:
    joint: JointGraph
    mesh_shape: tuple[int, ...]
    nodes: dict[fx.Node, NodeStrategy]
    fallbacks: list[str]
    """Ops replicated because DTensor has no (working) rule, as "node: op (reason)"."""
    pruned: int
    """Options dropped because they held ``_StridedShard`` or uneven shards."""
    mesh: Any = None
    """The (real or fake) DeviceMesh the options were enumerated on."""


def all_placements(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every even Replicate/Shard placement of a tensor of ``shape``."""
    per_dim = [compat.Replicate()] + [compat.Shard(d) for d in range(len(shape))]
    choices = [per_dim if n > 1 else [compat.Replicate()] for n in mesh_shape]
    return [
        pl for pl in itertools.product(*choices) if local_shape(shape, pl, mesh_shape) is not None
    ]


def _trivial_dims_replicated(placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """Size-1 mesh dims carry ``Replicate`` only (any other placement is the same data)."""
    return all(n > 1 or isinstance(p, compat.Replicate) for p, n in zip(placements, mesh_shape))


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    leaves = compat.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and tensor_vals(a)]


def _spec(mesh, pl: Placements, t: torch.Tensor):
    return compat.make_spec(mesh, pl, compat.tensor_meta(t))


def _strategy_of(ns: NodeStrategy, idx: int, mesh, restrict: Placements | None, cache: dict):
    """DTensor ``OpStrategy`` of a producer's output (all its placements, or one)."""
    key = (ns.node, idx, restrict)
    hit = cache.get(key)
    if hit is None:
        val = tensor_vals(ns.node)[idx]
        seen = list(dict.fromkeys(o.out[idx] for o in ns.options))
        if restrict is not None:
            seen = [pl for pl in seen if pl == restrict]
        hit = cache[key] = compat.OpStrategy([compat.OpSpec(_spec(mesh, pl, val)) for pl in seen])
    return hit


def _placements_of(spec) -> Placements | None:
    return None if spec is None else tuple(spec.placements)


class _Enumerator:
    def __init__(self, joint: JointGraph, mesh):
        self.joint = joint
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.nodes: dict[fx.Node, NodeStrategy] = {}
        self.fallbacks: list[str] = []
        self.pruned = 0
        self._strategy_cache: dict = {}
        self.kind_of = {}
        for n in joint.params.values():
            self.kind_of[n] = "param"
        for n in joint.buffers.values():
            self.kind_of[n] = "buffer"
        for n in joint.inputs.values():
            self.kind_of[n] = "input"
        for n in joint.tangents.values():
            self.kind_of[n] = "tangent"

    def run(self) -> Strategies:
        with compat.unset_fake_temporarily(), compat.cheap_redistribute_costs():
            for node in self.joint.gm.graph.nodes:
                if node.op == "placeholder":
                    self._placeholder(node)
                elif node.op == "call_function":
                    self._call(node)
        return Strategies(
            self.joint, self.mesh_shape, self.nodes, self.fallbacks, self.pruned, self.mesh
        )

    def _placeholder(self, node: fx.Node) -> None:
        vals = tensor_vals(node)
        ns = NodeStrategy(node, self.kind_of[node], edges=[])
        if vals:
            ns.options = [Option((pl,), ()) for pl in all_placements(vals[0].shape, self.mesh_shape)]
        self.nodes[node] = ns

    def _replicated(self, node: fx.Node, edges) -> list[Option]:
        rep = tuple(compat.Replicate() for _ in self.mesh_shape)
        outs = tuple(rep if v is not None else None for v in tensor_vals(node))
        return [Option(outs, tuple(rep for _ in edges))]

    def _call(self, node: fx.Node) -> None:
        args = _tensor_args(node)
        if node.target is operator.getitem:
            src, idx = node.args[0], node.args[1]
            ns = NodeStrategy(node, "getitem", edges=[(src, idx)])
            seen = []
            for o in self.nodes[src].options:
                if o.out[idx] not in seen:
                    seen.append(o.out[idx])
            ns.options = [Option((pl,), (pl,)) for pl in seen]
            ns.follows = {o: o.ins for o in ns.options}
            self.nodes[node] = ns
            return
        edges = [(a, 0) for a in args]
        if not tensor_vals(node):
            self.nodes[node] = NodeStrategy(node, "const", edges, options=[])
            return
        if not args:
            ns = NodeStrategy(node, "const", edges, options=self._replicated(node, edges))
            self.nodes[node] = ns
            return
        ns = NodeStrategy(node, "op", edges)
        ns.options, ns.follows, reason = self._ask_dtensor(node, args)
        hooks = op_hooks.hooks_of(node.target)
        if hooks is not None and ns.options:  # an op that communicates inside its kernel
            ns.options = [o for o in hooks.extra_options(node, ns.options, self.mesh_shape)
                          if self._even(node, o)]
        if not ns.options:
            ns.options = self._replicated(node, edges)
            ns.fallback = True
            self.fallbacks.append(f"{node.name}: {node.target} ({reason})")
            if (key := f"{node.target} ({reason})") not in _WARNED:
                _WARNED.add(key)
                logger.warning("no DTensor sharding rule for %s: replicated on every device "
                               "of the stage (shown in the plan's describe(); "
                               "PlannerOptions(strict=True) makes it an error)", key)
        self.nodes[node] = ns

    def _schema_args(self, node: fx.Node, pick: dict[fx.Node, Placements] | None = None):
        single_dim = compat.is_single_dim_rule(node.target)

        def conv(a):
            if isinstance(a, fx.Node) and tensor_vals(a):
                val = tensor_vals(a)[0]
                if single_dim:
                    # One option per input: a plain Shard tells the rule which kind to expand.
                    pl = [compat.Replicate() for _ in self.mesh_shape]
                    if val.dim() > 0:
                        pl[0] = compat.Shard(0)
                    return compat.OpStrategy([compat.OpSpec(_spec(self.mesh, tuple(pl), val))])
                restrict = None if pick is None else pick.get(a)
                return _strategy_of(self.nodes[a], 0, self.mesh, restrict, self._strategy_cache)
            if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
                return compat.TupleStrategy([conv(x) for x in a])
            return a

        def walk(x):
            if isinstance(x, (list, tuple)) and x and all(isinstance(y, fx.Node) for y in x):
                return conv(x)
            if isinstance(x, (list, tuple)):
                return type(x)(walk(y) for y in x)
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            return conv(x)

        return tuple(walk(a) for a in node.args), {k: walk(v) for k, v in node.kwargs.items()}

    def _out_meta(self, node: fx.Node):
        vals = tensor_vals(node)
        metas = [compat.tensor_meta(v) if v is not None else None for v in vals]
        return metas[0] if isinstance(node.meta.get("val"), torch.Tensor) else tuple(metas)

    def _query(self, node: fx.Node, pick=None):
        args, kwargs = self._schema_args(node, pick)
        return compat.op_strategy(node.target, args, kwargs, self._out_meta(node), self.mesh)

    def _ask_dtensor(self, node: fx.Node, args: list[fx.Node]):
        if not compat.is_op_overload(node.target):
            return [], None, "not an aten op"
        if not compat.has_rule(node.target):
            if not compat.has_decomp_rule(node.target):
                return [], None, "no DTensor rule"
            return self._ask_decomposition(node, args)
        results = []  # (producer placement or None, strategy)
        distinct = list(dict.fromkeys(args))
        follow = (
            not compat.is_single_dim_rule(node.target)
            and len(args) == 1
            and len(self.nodes[args[0]].options) > 1
        )
        try:
            if follow:
                # View rules and friends follow one input: ask once per producer placement.
                src = distinct[0]
                for pl in dict.fromkeys(o.out[0] for o in self.nodes[src].options):
                    try:
                        results.append((pl, self._query(node, {src: pl})))
                    except Exception:  # noqa: BLE001 - a rule rejecting one placement
                        continue
            else:
                results.append((None, self._query(node)))
        except Exception as e:  # noqa: BLE001 - any failing rule falls back, and is reported
            return [], None, f"rule failed: {type(e).__name__}: {str(e)[:80]}"
        options: dict[Option, list] = {}
        for src_pl, strat in results:
            for spec in getattr(strat, "strategies", []):
                opt = self._option(node, spec, len(args))
                if opt is not None:
                    options.setdefault(opt, [])
                    if src_pl is not None and src_pl not in options[opt]:
                        options[opt].append(src_pl)
        if not options:
            return [], None, "rule gave no usable option"
        if len(args) == 1:
            # A single-input op is only ever fed its producer's placements as they are.
            have = {o.out[0] for o in self.nodes[args[0]].options}
            options = {o: v for o, v in options.items() if o.ins[0] in have}
            if not options:
                return [], None, "no option accepts its producer's placements"
        follows = None
        if follow:
            follows = {o: tuple(v) for o, v in options.items()}
        elif len(args) == 1:
            # A single-input op whose rule enumerated every combination: link each option
            # only to the identical producer placement (redistribute before, not into, it).
            follows = {o: (o.ins[0],) for o in options}
        return list(options), follows, ""

    def _ask_decomposition(self, node: fx.Node, args: list[fx.Node]):
        """Next resort for an op with no rule: DTensor traces its decomposition."""

        def spec(a):
            if isinstance(a, fx.Node) and tensor_vals(a):
                val = tensor_vals(a)[0]
                # a Shard among the inputs makes DTensor try Shard on every tensor dim
                pl = [compat.Replicate() for _ in self.mesh_shape]
                if val.dim() > 0:
                    pl[0] = compat.Shard(0)
                return _spec(self.mesh, tuple(pl), val)
            return a

        try:
            strat = compat.decomp_op_strategy(
                node.target,
                tuple(fx.node.map_arg(node.args, spec)),
                dict(fx.node.map_arg(node.kwargs, spec)),
            )
        except Exception as e:  # noqa: BLE001 - reported as a fallback
            return [], None, f"decomposition failed: {type(e).__name__}: {str(e)[:80]}"
        options = {}
        for s in getattr(strat, "strategies", None) or []:
            opt = self._option(node, s, len(args))
            if opt is not None:
                options[opt] = None
        if not options:
            return [], None, "no DTensor rule; decomposition gave no usable option"
        return list(options), None, ""

    def _fits(self, pairs) -> bool:
        """Every (tensor value, placements) pair has placements that divide it evenly."""
        return all(v is None or (pl is not None
                                 and local_shape(v.shape, pl, self.mesh_shape) is not None)
                   for v, pl in pairs)

    def _even(self, node: fx.Node, opt: Option) -> bool:
        """Every input and output of ``opt`` divides evenly over the mesh."""
        return (self._fits(zip(tensor_vals(node), opt.out))
                and self._fits((tensor_vals(a)[0], pl)
                               for a, pl in zip(_tensor_args(node), opt.ins)))

    def _option(self, node: fx.Node, spec, n_args: int) -> Option | None:
        vals = tensor_vals(node)
        outs = spec.output_specs
        outs = outs if isinstance(outs, tuple) else (outs,)
        out_pl = [_placements_of(s) if v is not None else None for v, s in zip(vals, outs)]
        if not self._fits(zip(vals, out_pl)):
            self.pruned += 1
            return None
        if spec.input_specs is None:
            ins = [out_pl[0]] * n_args
        else:
            ins = [_placements_of(s) for s in spec.input_specs]
        if len(ins) != n_args:
            return None
        if not all(
            _trivial_dims_replicated(pl, self.mesh_shape) for pl in [*out_pl, *ins] if pl
        ):
            return None
        if not self._fits((tensor_vals(a)[0], pl) for a, pl in zip(_tensor_args(node), ins)):
            self.pruned += 1
            return None
        return Option(tuple(out_pl), tuple(ins))


def enumerate_strategies(joint: JointGraph, mesh) -> Strategies:
    """Candidate options of every node of ``joint`` on ``mesh`` (a real or fake DeviceMesh)."""
    return _Enumerator(joint, mesh).run()


_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def reduce_after_cast(strategies: Strategies) -> int:
    """Pin each gradient-output cast node to take its input unredistributed (so reductions of
    a partial gradient happen after the cast, in the master dtype). Returns how many."""
    joint = strategies.joint
    n = 0
    for g in joint.grads.values():
        ns = strategies.nodes.get(g)
        if ns is None or g.target not in _CASTS or not ns.options or len(ns.edges) != 1:
            continue
        ns.follows = {o: (o.ins[0],) for o in ns.options}
        n += 1
    return n
