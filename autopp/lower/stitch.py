"""A planned stage's local joint graph stitched from its units' traces, each distinct unit
traced once.

Lowering a unit costs about a second per block on a CPU, and a stage's blocks are usually one
plan repeated. :func:`stitch_stage` traces each distinct unit once as a *piece* (forward
nodes, a marker, backward nodes, with inputs already in the placements it reads them in), and
the moves between units on their own; it then writes the stage graph in the order one trace of
the whole stage runs: every unit's forward, the output's move, every unit's backward in
reverse, each piece copied in once per unit.

Key of a piece: the unit's plan (signature and placements) and its inputs' placements, shapes
and strides. A piece is first traced for the output gradient its own output would have, and
traced again in the rare case where the next unit's input gradient arrives otherwise."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import logging

import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from autopp._compat import sharding as compat
from autopp.lower.interpret import GraphRunner, local_in, redistribute_to
from autopp.sharding.plan import BlockPlan
from autopp.tracing.joint import JointGraph

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class End:
    """A value crossing between units: its placements and its global shape, stride and
    dtype (what ``DTensor.from_local`` needs to wrap the local tensor again)."""

    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(value: Any, placements: tuple | None = None) -> End:
        """The end of a DTensor, or of a meta value in ``placements``."""
        pl = tuple(value.placements) if placements is None else tuple(placements)
        return End(pl, tuple(value.shape), tuple(value.stride()), value.dtype)

    def moved(self, target: tuple) -> End:
        """This end after :func:`~autopp.lower.interpret.redistribute_to` ``target`` (a
        planned ``Partial`` keeps what the value holds)."""
        pl = tuple(h if isinstance(p, compat.Partial) else p
                   for p, h in zip(target, self.placements))
        return dataclasses.replace(self, placements=pl)

    def wrap(self, local: torch.Tensor, mesh: Any) -> DTensor:
        return DTensor.from_local(local, mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def example(self, mesh: Any, device: torch.device) -> torch.Tensor:
        """An empty local tensor of this rank's shard (under the caller's fake mode)."""
        return torch.empty(compat.local_shape(self.shape, mesh, self.placements),
                           dtype=self.dtype, device=device)


@dataclasses.dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit of the stage, as :func:`stitch_stage` traces it."""

    joint: JointGraph
    plan: BlockPlan
    runner: GraphRunner
    decomps: dict
    """Decompositions for the unit's ops with no kernel on the device."""


@dataclasses.dataclass(slots=True)
class _Piece:
    gm: fx.GraphModule
    forward: list[fx.Node]
    backward: list[fx.Node]
    out: End
    """The unit's output as its forward leaves it (a placement may be Partial)."""
    in_grad: End | None
    """Its input gradient as its backward leaves it; None when it has none."""


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="placeholder"))


def _returned(gm: fx.GraphModule) -> list[fx.Node]:
    (out,) = gm.graph.find_nodes(op="output")
    got = out.args[0]
    return [got] if isinstance(got, fx.Node) else list(got)


def _trace_piece(spec: UnitSpec, mesh: Any, fake: Any, device: torch.device, h: End,
                 kws: Sequence[End], g: End) -> _Piece:
    """Trace one unit: parameters, buffers, ``h``, ``kws`` and ``g`` in, its output (local,
    as the forward leaves it), parameter gradients (in their placements) and input gradient
    (local, as the backward leaves it) out."""
    j, r = spec.joint, spec.runner
    ends = [End.of(n.meta["val"], r.placement(n)) for n in j.params.values()]
    ends += [End.of(n.meta["val"], r.placement(n)) for n in j.buffers.values()]
    n_p, n_b = len(j.params), len(j.buffers)
    ends += [h, *kws, g]
    with fake:
        examples = [e.example(mesh, device) for e in ends]
    seen: dict[str, End | None] = {}

    def piece(*local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wrapped = [e.wrap(t, mesh) for t, e in zip(local[:-1], ends[:-1])]
        env: dict[fx.Node, Any] = dict(zip(j.params.values(), wrapped[:n_p]))
        env.update(zip(j.buffers.values(), wrapped[n_p:n_p + n_b]))
        raw = dict(zip(j.buffers.values(), local[n_p:n_p + n_b]))
        for i, node in sorted(j.inputs.items()):
            env[node] = redistribute_to(wrapped[n_p + n_b + i], r.placement(node))
        # buffers the forward writes (e.g. MoE token counts) are written in place before
        # the rest of the forward runs: the graph split keeps forward mutations that come
        # before the stage output
        first = r.ancestors(list(j.buffer_updates.values()))
        r.run(env, first)
        for bnode, value in r.buffer_updates(env):
            raw[bnode].copy_(value.to_local())
        r.run(env, r.fwd_needed - first)
        out = env[j.outputs[0]]
        seen["out"] = End.of(out)
        out_local = out.to_local()  # before the marker: the forward returns it
        torch.ops.aten.alias.default(local[-1])  # the marker: the backward starts here
        env[j.tangents[0]] = redistribute_to(g.wrap(local[-1], mesh), r.placement(j.tangents[0]))
        r.run(env, {n for n in j.gm.graph.nodes if n not in r.fwd_needed})
        grads = []
        for fqn, pnode in j.params.items():
            gnode = j.grads.get(fqn)
            if gnode is None or env.get(gnode) is None:
                grads.append(torch.zeros_like(env[pnode].to_local()))
            else:
                grads.append(local_in(env[gnode], r.placement(pnode)))
        gin = env.get(j.input_grads[0]) if 0 in j.input_grads else None
        seen["in_grad"] = None if gin is None else End.of(gin)
        return (out_local, *grads, *(() if gin is None else (gin.to_local(),)))

    gm = make_fx(piece, decomposition_table=spec.decomps, tracing_mode="fake")(*examples)
    g_ph = _placeholders(gm)[-1]
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    at = next(i for i, n in enumerate(body) if n.target is torch.ops.aten.alias.default
              and n.args[0] is g_ph and not n.users)
    forward, backward = body[:at], body[at + 1:]
    touched = {g_ph}
    for n in forward:  # nothing the forward computes may read the output gradient
        if any(a in touched for a in n.all_input_nodes):
            raise AssertionError(f"forward node {n.name} of a unit reads its output gradient")
    return _Piece(gm, forward, backward, seen["out"], seen["in_grad"])


class _Writer:
    """Writes the stage graph: placeholders, copies of traced nodes, moves, the output."""

    def __init__(self, mesh: Any, fake: Any, device: torch.device):
        self.graph, self.root = fx.Graph(), torch.nn.Module()
        self.mesh, self.fake, self.device = mesh, fake, device
        self._moves: dict[tuple, fx.GraphModule] = {}
        self._n_attrs = 0

    def copy(self, gm: fx.GraphModule, nodes: Sequence[fx.Node], env: dict[fx.Node, Any]) -> None:
        for n in nodes:
            if n.op == "get_attr":  # a constant the trace lifted
                name = f"_stitched_constant{self._n_attrs}"
                self._n_attrs += 1
                setattr(self.root, name, functools.reduce(getattr, n.target.split("."), gm))
                new = self.graph.get_attr(name)
                new.meta = copy.copy(n.meta)
            else:
                new = self.graph.node_copy(n, lambda a: env[a])
            env[n] = new

    def move(self, node: fx.Node, src: End, target: tuple, *, exact: bool = False) -> fx.Node:
        """``node`` (a local tensor at ``src``) moved to ``target``; ``exact``: returned in
        exactly ``target`` (an output; no Partial), else as ``redistribute_to`` leaves it."""
        if tuple(target) == src.placements:
            return node
        key = (src, tuple(target), exact)
        gm = self._moves.get(key)
        if gm is None:
            def fn(t: torch.Tensor) -> torch.Tensor:
                d = src.wrap(t, self.mesh)
                return local_in(d, target) if exact else redistribute_to(d, target).to_local()

            with self.fake:
                example = src.example(self.mesh, self.device)
            gm = self._moves[key] = make_fx(fn, tracing_mode="fake")(example)
        env: dict[fx.Node, Any] = {_placeholders(gm)[0]: node}
        self.copy(gm, [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")], env)
        return env[_returned(gm)[0]]


def stitch_stage(specs: Sequence[UnitSpec], mesh: Any, fake: Any,
                 examples: Sequence[torch.Tensor], *, n_p: int, n_b: int, x_end: End,
                 kw_ends: Sequence[End], out_end: End, has_input_grad: bool) -> fx.GraphModule:
    """The stage's local joint graph (see :func:`autopp.lower.local_graphs.lower_stage` for
    its inputs and outputs), from one trace per distinct unit. ``examples``: the graph's
    inputs as fake tensors of ``fake`` (parameters, buffers, stage input, keyword inputs,
    output gradient); ``x_end``, ``kw_ends``, ``out_end``: the stage input's, keyword
    inputs' and output's planned ends."""
    device = examples[0].device if examples else torch.device("cpu")
    pieces: dict[tuple, _Piece] = {}

    def piece_for(spec: UnitSpec, h: End, kws: tuple[End, ...], g: End) -> _Piece:
        key = (spec.plan.signature, spec.plan.nodes, h, kws, g)
        if key not in pieces:
            pieces[key] = _trace_piece(spec, mesh, fake, device, h, kws, g)
        return pieces[key]

    # what each unit takes in: its input after the previous unit's output has moved, ...
    ins: list[tuple[End, tuple[End, ...]]] = []
    used: list[_Piece] = []
    h = x_end
    for spec in specs:
        r, j = spec.runner, spec.joint
        h = h.moved(r.placement(j.inputs[0]))
        kws = tuple(e.moved(r.placement(j.inputs[i])) for i, e in enumerate(kw_ends, start=1))
        out_val = j.outputs[0].meta["val"]
        guess = End.of(out_val, r.placement(j.tangents[0]))  # the next unit's own placement
        ins.append((h, kws))
        used.append(piece_for(spec, h, kws, guess))
        h = used[-1].out
    # ... and its output gradient as the next unit's input gradient (or the stage's output
    # gradient) arrives: traced again where the first guess was not it
    grads_in: list[End] = [out_end] * len(specs)
    for k in reversed(range(len(specs))):
        spec = specs[k]
        src = out_end if k == len(specs) - 1 else used[k + 1].in_grad
        g = src.moved(spec.runner.placement(spec.joint.tangents[0]))
        grads_in[k] = g
        if (spec.plan.signature, spec.plan.nodes, *ins[k], g) not in pieces:
            again = piece_for(spec, *ins[k], g)
            if again.out != used[k].out:
                raise AssertionError(f"unit {k}'s output changed with its output gradient")
            used[k] = again

    logger.debug("stage lowered from %d trace(s) of its %d unit(s)", len(pieces), len(specs))
    w = _Writer(mesh, fake, device)
    phs = []
    for i, ex in enumerate(examples):
        ph = w.graph.placeholder(f"arg{i}_1")
        ph.meta["val"] = ex
        phs.append(ph)
    params, bufs = iter(phs[:n_p]), iter(phs[n_p:n_p + n_b])
    x, kw_phs, g_ph = phs[n_p + n_b], phs[n_p + n_b + 1:-1], phs[-1]
    envs: list[dict[fx.Node, Any]] = []
    node, at = x, x_end
    for spec, piece, (h_in, kws_in) in zip(specs, used, ins):
        j = spec.joint
        piece_phs = _placeholders(piece.gm)
        env: dict[fx.Node, Any] = {}
        for ph in piece_phs[:len(j.params)]:
            env[ph] = next(params)
        for ph in piece_phs[len(j.params):len(j.params) + len(j.buffers)]:
            env[ph] = next(bufs)
        n_in = len(j.params) + len(j.buffers)
        env[piece_phs[n_in]] = w.move(node, at, h_in.placements)
        for ph, kw_node, e, e_in in zip(piece_phs[n_in + 1:-1], kw_phs, kw_ends, kws_in):
            env[ph] = w.move(kw_node, e, e_in.placements)
        w.copy(piece.gm, piece.forward, env)
        node, at = env[_returned(piece.gm)[0]], piece.out
        envs.append(env)
    res: list[fx.Node] = [w.move(node, at, out_end.placements, exact=True)]
    grads: list[list[fx.Node]] = []
    node, at = g_ph, out_end
    for k in reversed(range(len(specs))):
        piece, env, j = used[k], envs[k], specs[k].joint
        env[_placeholders(piece.gm)[-1]] = w.move(node, at, grads_in[k].placements)
        w.copy(piece.gm, piece.backward, env)
        returned = [env[n] for n in _returned(piece.gm)]
        grads.append(returned[1:1 + len(j.params)])
        if piece.in_grad is not None:
            node, at = returned[-1], piece.in_grad
    for unit_grads in reversed(grads):
        res += unit_grads
    if has_input_grad:
        res.append(w.move(node, at, x_end.placements, exact=True))
    w.graph.output(tuple(res))
    return fx.GraphModule(w.root, w.graph)
