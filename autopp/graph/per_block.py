"""Weights gathered and gradients reduced block by block inside a stage's graphs (FSDP's
memory), from the graphs that gather once per step.

:func:`per_block_stage_graphs` rewrites a peeled stage: the forward runs each block's part of
the unshard graph just before the block's first use (all-gathers issued ``prefetch`` blocks
ahead, waited at first use) and saves the *shards*, never a gathered value (SimpleFSDP's
policy); the backward-input or full backward gathers each block again in backward order; the
graph that makes parameter gradients reduces each as soon as it exists, one block's
reductions in flight, and the runtime sums the reduced gradients over microbatches (summing
unreduced ones would keep them all step).

No unshard or reduce-grad graph remains, so every schedule, the I/W split and recomputation
run unchanged. A gather belongs to the lowest block of the parameters it reads
(``param_blocks``). Invariant: the values are those of the graphs given; only where work
runs moves."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.fx as fx

from autopp.graph.callables import StageGraphs
from autopp.graph.overlap import is_collective, is_wait
from autopp.graph.walk import closure

BLOCK_META = "autopp_block"
"""``node.meta`` key of an inlined gather's or reduction's collective: its block."""
KIND_META = "autopp_block_kind"
"""``node.meta`` key of an inlined collective: "gather" (weights) or "reduce" (gradients)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Unshard:
    """The unshard graph, read as per-value chains."""

    placeholders: list[fx.Node]
    frontier: list[fx.Node]
    chains: list[list[fx.Node]]  # per frontier value: its computing nodes, in graph order
    after_wait: frozenset[fx.Node]  # nodes computed from a wait (gathered values)
    blocks: list[int]  # per frontier value

    @staticmethod
    def of(gm: fx.GraphModule, param_indices: Sequence[int], param_blocks: Sequence[int]
           ) -> "_Unshard":
        phs = list(gm.graph.find_nodes(op="placeholder"))
        (out,) = gm.graph.find_nodes(op="output")
        frontier = list(out.args[0])
        block_of = {ph: param_blocks[i] for ph, i in zip(phs, param_indices)}
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        chains, blocks = [], []
        for f in frontier:
            nodes = closure([f])
            chains.append(sorted((n for n in nodes if n.op != "placeholder"),
                                 key=order.__getitem__))
            blocks.append(min((block_of[n] for n in nodes if n in block_of), default=0))
        after: set[fx.Node] = set()
        for n in gm.graph.nodes:
            if is_wait(n) or any(a in after for a in n.all_input_nodes):
                after.add(n)
        return _Unshard(phs, frontier, chains, frozenset(after), blocks)


class _Writer:
    """A new graph written node by node, with chains of another graph inlined into it."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}  # nodes of the graph being rewritten
        self.inl: dict[fx.Node, fx.Node] = {}  # nodes of the inlined graphs

    def _arg(self, a: fx.Node) -> fx.Node:
        return self.inl[a] if a in self.inl else self.env[a]

    def inline(self, n: fx.Node, block: int, kind: str = "gather") -> None:
        if n in self.inl:
            return
        new = self.graph.create_node(
            n.op, n.target, fx.node.map_arg(n.args, self._arg),
            fx.node.map_arg(n.kwargs, self._arg), name=f"blk_{n.name}")
        new.meta = dict(n.meta)
        if is_collective(n):
            new.meta[BLOCK_META] = block
            new.meta[KIND_META] = kind
        self.inl[n] = new

    def copy(self, n: fx.Node) -> fx.Node:
        new = self.graph.node_copy(n, self._arg)
        self.env[n] = new
        return new


def _gather_schedule(nodes: list[fx.Node], uses: dict[fx.Node, int], blocks: list[int],
                     prefetch: int, overlap: bool) -> dict[int, list[int]]:
    """{position in ``nodes``: frontier values whose gathers are issued just before it}:
    each block's at the first use of the block ``prefetch`` earlier in this graph's order
    (at its own first use without overlap). ``uses``: frontier placeholder -> index."""
    first: dict[int, int] = {}
    for pos, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if a in uses:
                first.setdefault(uses[a], pos)
    by_block: dict[int, list[int]] = {}
    for i in sorted(first, key=first.__getitem__):
        by_block.setdefault(blocks[i], []).append(i)
    order = sorted(by_block, key=lambda b: min(first[i] for i in by_block[b]))
    out: dict[int, list[int]] = {}
    for r, b in enumerate(order):
        ahead = order[max(0, r - prefetch)] if overlap else b
        pos = min(first[i] for i in by_block[ahead])
        out.setdefault(pos, []).extend(by_block[b])
    return out


def _rewrite(gm: fx.GraphModule, *, unshard: _Unshard, frontier_of: dict[fx.Node, int],
             new_placeholders: list[tuple[str, object]], shard_names: dict[fx.Node, str],
             outputs, prefetch: int, overlap: bool, reduce: "_Reduce | None" = None
             ) -> fx.GraphModule:
    """``gm`` with its frontier placeholders (``frontier_of``) computed in-graph from the
    shards. ``new_placeholders``: (name, old placeholder or the unshard placeholder it
    stands for) in the new order; ``outputs(env)``: the new output values."""
    w = _Writer()
    for name, src in new_placeholders:
        ph = w.graph.placeholder(name)
        ph.meta = dict(src.meta)
        if src in shard_names:
            w.inl[src] = ph
        else:
            w.env[src] = ph
            if reduce is not None:
                reduce.after(src, w, overlap)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    schedule = _gather_schedule(body, frontier_of, unshard.blocks, prefetch, overlap)

    def issue(i: int) -> None:
        for n in unshard.chains[i]:
            if n not in unshard.after_wait:
                w.inline(n, unshard.blocks[i])

    def finish(i: int) -> fx.Node:
        for n in unshard.chains[i]:
            w.inline(n, unshard.blocks[i])
        return w.inl[unshard.frontier[i]]

    for pos, n in enumerate(body):
        for i in schedule.get(pos, ()):
            issue(i)
        for a in n.all_input_nodes:
            if a in frontier_of and a not in w.env:
                w.env[a] = finish(frontier_of[a])
        w.copy(n)
        if reduce is not None:
            reduce.after(n, w, overlap)
    if reduce is not None:
        reduce.flush(w)
    (out,) = gm.graph.find_nodes(op="output")
    w.graph.output(outputs(w, out))
    w.graph.lint()
    return fx.GraphModule(gm, w.graph)


class _Reduce:
    """The reduce-grad graph's chains, inlined into the graph that makes the gradients as
    soon as each gradient exists; a block's waits (and what follows them) are written when
    the next block's reductions are issued, or at the end."""

    def __init__(self, gm: fx.GraphModule, grads: list[fx.Node], blocks: list[int]):
        self.gm = gm
        phs = list(gm.graph.find_nodes(op="placeholder"))
        self.src = dict(zip(phs, grads))  # reduce placeholder -> gradient node
        self.nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        block = dict(zip(phs, blocks))
        self.block = {n: min((block[p] for p in closure([n]) if p in block), default=0)
                      for n in self.nodes}
        after: set[fx.Node] = set()
        for n in self.nodes:
            if is_wait(n) or any(a in after for a in n.all_input_nodes):
                after.add(n)
        self.after_wait = frozenset(after)
        self.pending: int | None = None  # the block whose reductions are in flight

    def _ready(self, n: fx.Node, w: _Writer) -> bool:
        return n not in w.inl and all(a in w.inl for a in n.all_input_nodes)

    def after(self, n: fx.Node, w: _Writer, overlap: bool) -> None:
        """``n`` was written: issue the reductions its value completes."""
        hit = [ph for ph, g in self.src.items() if g is n]
        if not hit:
            return
        for ph in hit:
            w.inl[ph] = w.env[n]
        for r in self.nodes:
            if r in self.after_wait or not self._ready(r, w):
                continue
            b = self.block[r]
            if is_collective(r) and self.pending not in (None, b):
                self.flush(w, self.pending)
            w.inline(r, b, "reduce")
            if is_collective(r):
                self.pending = b
        if not overlap and self.pending is not None:
            self.flush(w, self.pending)

    def flush(self, w: _Writer, block: int | None = None) -> None:
        """Write every reduction node (of ``block``; None: of any) whose inputs exist,
        waits included, in graph order, until none is left that can be."""
        changed = True
        while changed:
            changed = False
            for r in self.nodes:
                if (block is None or self.block[r] == block) and self._ready(r, w):
                    w.inline(r, self.block[r], "reduce")
                    changed = True
        self.pending = None

    def outputs(self, w: _Writer) -> list:
        (out,) = self.gm.graph.find_nodes(op="output")
        return [fx.node.map_arg(v, lambda a: w.inl[a]) for v in out.args[0]]


def per_block_stage_graphs(graphs: StageGraphs, param_blocks: Sequence[int], *,
                           prefetch: int = 1, overlap: bool = True) -> StageGraphs:
    """``graphs`` (peeled: an unshard and/or reduce-grad graph) rewritten to gather each
    block's weights in the forward and again in the backward, and to reduce each block's
    gradients in the backward (module docstring). ``param_blocks``: the block of each flat
    parameter; ``prefetch``: how many blocks ahead a gather is issued (with ``overlap``;
    without it each collective is waited where it is issued). The graphs given are not
    modified; with neither graph, they are returned as they are."""
    if graphs.unshard_graph is None and graphs.reduce_grad_graph is None:
        return graphs
    if prefetch < 0:
        raise ValueError(f"prefetch is a number of blocks, >= 0; got {prefetch}")
    conv = graphs.convention
    sig = conv.signature
    if len(param_blocks) != sig.num_params:
        raise ValueError(f"param_blocks names {len(param_blocks)} blocks for "
                         f"{sig.num_params} parameters; give one per flat parameter")
    nfw, nbu = conv.num_unsharded_params, conv.num_backward_unsharded
    if graphs.unshard_graph is not None:
        unshard = _Unshard.of(graphs.unshard_graph, conv.unshard_param_indices, param_blocks)
        param_index = dict(zip(unshard.placeholders, conv.unshard_param_indices))
    else:
        unshard = _Unshard([], [], [], frozenset(), [])
        param_index = {}
    shard_names = {ph: f"shard_{i}_{ph.name}" for ph, i in param_index.items()}

    # forward: shards (every parameter the unshard graph reads) in the place of the
    # frontier values; saves the shards the backward gathers from instead of gathered values
    fw = graphs.forward_graph
    fw_phs = list(fw.graph.find_nodes(op="placeholder"))
    fw_frontier = {ph: i for i, ph in enumerate(fw_phs[:nfw])}
    by_name = {ph.name: i for ph, i in fw_frontier.items()}
    n_saved = conv.num_saved_for_backward
    bw_frontier_idx: list[int | None] = [by_name.get(s) for s in conv.saved_for_backward]
    bw_frontier_idx += [nfw + s if s < nbu else None for s in conv.output_grad_inputs]
    needed = closure([unshard.frontier[i] for i in bw_frontier_idx if i is not None])
    bw_shards = [ph for ph in unshard.placeholders if ph in needed]

    def fw_outputs(w: _Writer, out: fx.Node) -> tuple:
        vals = list(out.args[0])
        n_out = sig.num_outputs
        kept = [v for v, fi in zip(vals[n_out:], bw_frontier_idx[:n_saved]) if fi is None]
        return (*[w.env[v] if isinstance(v, fx.Node) else v for v in vals[:n_out]],
                *[w.env[v] if isinstance(v, fx.Node) else v for v in kept],
                *[w.inl[ph] for ph in bw_shards])

    new_fw = _rewrite(
        fw, unshard=unshard, frontier_of=fw_frontier,
        new_placeholders=[(shard_names[ph], ph) for ph in unshard.placeholders]
        + [(ph.name, ph) for ph in fw_phs[nfw:]],
        shard_names=shard_names, outputs=fw_outputs, prefetch=prefetch, overlap=overlap)
    fw_out = list(next(iter(new_fw.graph.find_nodes(op="output"))).args[0])
    saved_names = tuple(v.name for v in fw_out[sig.num_outputs:])
    kept_saved = [s for s, fi in zip(conv.saved_for_backward, bw_frontier_idx) if fi is None]
    grad_inputs = tuple(s - nbu for s in conv.output_grad_inputs if s >= nbu)

    reduce_blocks = [param_blocks[i] for i in conv.reduce_grad_inputs]

    def backward(gm: fx.GraphModule | None, makes_grads: bool) -> fx.GraphModule | None:
        if gm is None:
            return None
        phs = list(gm.graph.find_nodes(op="placeholder"))
        frontier_of = {ph: fi for ph, fi in zip(phs, bw_frontier_idx) if fi is not None}
        plain = [ph for ph, fi in zip(phs, bw_frontier_idx) if fi is None]
        new_phs = ([(ph.name, ph) for ph in plain[:len(kept_saved)]]
                   + [(f"{shard_names[ph]}", ph) for ph in bw_shards]
                   + [(ph.name, ph) for ph in plain[len(kept_saved):]])
        return _rewrite_grads(gm, makes_grads, unshard=unshard, frontier_of=frontier_of,
                              new_placeholders=new_phs)

    def _rewrite_grads(gm, makes_grads, **kw):
        red = None
        if makes_grads and graphs.reduce_grad_graph is not None:
            (out,) = gm.graph.find_nodes(op="output")
            grads = list(out.args[0])[: sig.num_param_grads]
            red = _Reduce(graphs.reduce_grad_graph,
                          [grads[i] for i in conv.reduce_grad_inputs], reduce_blocks)

        def outs(w: _Writer, out: fx.Node) -> tuple:
            vals = [fx.node.map_arg(v, lambda a: w.env[a]) for v in out.args[0]]
            if red is not None:
                vals[: sig.num_param_grads] = red.outputs(w)
            return tuple(vals)

        return _rewrite(gm, shard_names=shard_names, outputs=outs, prefetch=prefetch,
                        overlap=overlap, reduce=red, **kw)

    new_full = backward(graphs.full_backward_graph, True)
    new_bi = backward(graphs.backward_input_graph, False)
    new_bw = None
    if graphs.backward_weight_graph is not None:
        bw = graphs.backward_weight_graph
        new_bw = _rewrite_grads(bw, True, unshard=unshard, frontier_of={},
                                new_placeholders=[(ph.name, ph) for ph in
                                                  bw.graph.find_nodes(op="placeholder")])
    bw_inputs = tuple(ph.name for ph in new_full.graph.find_nodes(op="placeholder"))
    convention = dataclasses.replace(
        conv,
        saved_for_backward=saved_names,
        backward_inputs=bw_inputs,
        output_grad_inputs=grad_inputs,
        num_unsharded_params=0,
        forward_input_indices=(*(param_index[ph] for ph in unshard.placeholders),
                               *conv.forward_input_indices),
        unshard_param_indices=(),
        reduce_grad_inputs=(),
        num_backward_unsharded=0,
    )
    return dataclasses.replace(
        graphs, forward_graph=new_fw, full_backward_graph=new_full,
        backward_input_graph=new_bi, backward_weight_graph=new_bw, convention=convention,
        unshard_graph=None, reduce_grad_graph=None, runners={}, _issued={})


def blocks_in_flight(gm: fx.GraphModule) -> int:
    """The most blocks whose gathered weights are alive at once in ``gm`` (a graph of
    :func:`per_block_stage_graphs`): a block's from its first gather's issue to the last
    node that reads what its gathers made. ``prefetch + 1`` where the blocks' compute is
    long enough to reach; what the per-block memory estimate assumes."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    span: dict[int, list[int]] = {}
    for n in gm.graph.nodes:
        if n.meta.get(KIND_META) != "gather":
            continue
        end, stack, seen = pos[n], [n], set()
        while stack:  # the gather's chain (inlined nodes), then who reads it
            m = stack.pop()
            for u in m.users:
                end = max(end, pos[u])
                if u.name.startswith("blk_") and u not in seen and u.op != "output":
                    seen.add(u)
                    stack.append(u)
        s = span.setdefault(n.meta[BLOCK_META], [pos[n], end])
        s[0], s[1] = min(s[0], pos[n]), max(s[1], end)
    events = sorted([(a, 1) for a, _ in span.values()] + [(b, -1) for _, b in span.values()],
                    key=lambda e: (e[0], -e[1]))
    live = most = 0
    for _, d in events:
        live += d
        most = max(most, live)
    return most


def block_collectives(gm: fx.GraphModule, kind: str) -> int:
    """How many collectives of ``kind`` ("gather": of weights, "reduce": of gradients) the
    per-block rewrite inlined into ``gm``."""
    return sum(1 for n in gm.graph.nodes if n.meta.get(KIND_META) == kind)
