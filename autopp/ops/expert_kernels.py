"""The local kernels of routed experts, called by the op (:mod:`autopp.ops.experts`): the
grouped SwiGLU MLP over tokens sorted by expert, the score-weighted combine, the all-to-all
token exchange (:func:`dispatched`; its planner side is
:mod:`autopp.sharding.options.expert_dispatch`) and their backwards (:func:`local_backward`,
:func:`dispatched_backward`).

The forward sorts this device's ``(token, k)`` rows by expert (:func:`sort_routed`, stable)
and returns its routing in tensors whose shapes do not depend on it: ``order`` (the rows
sorted by expert) and ``counts`` ``(2, E)`` (rows routed to each expert; with all-to-all
dispatch, the rows received from each source for each local expert, rank-major). The
backward reads its sizes from them in one host sync, sorts nothing and exchanges no counts."""

from __future__ import annotations

import torch
from torch import Tensor

from autopp._compat import sharding as compat
from autopp._compat.ops import grouped_mm

_DTYPES = {"": None, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32}


def expert_mlp(routed_x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
               compute_dtype: str) -> Tensor:
    """SwiGLU experts on tokens sorted by (local) expert, ``counts[e]`` rows each, as
    torchtitan's ``GroupedExperts`` computes them; the result in ``routed_x``'s dtype."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    dt = _DTYPES[compute_dtype]
    cast = (lambda t: t.to(dt)) if dt is not None else (lambda t: t)
    # the tokens are cast once per use, as torchtitan does: their gradient is then summed
    # in fp32, not in the compute dtype
    h = torch.nn.functional.silu(
        grouped_mm(cast(routed_x), cast(w1).transpose(-2, -1), offs=offsets))
    h = h * grouped_mm(cast(routed_x), cast(w3).transpose(-2, -1), offs=offsets)
    return grouped_mm(h, cast(w2).transpose(-2, -1), offs=offsets).type_as(routed_x)


def scaled(y: Tensor, routed_scores: Tensor) -> Tensor:
    """Each routed output scaled by its score, in fp32 (torchtitan's combine)."""
    return (y.to(torch.float32) * routed_scores.reshape(-1, 1)).to(y.dtype)


def scatter_rows(rows: Tensor, token_of: Tensor, like: Tensor) -> Tensor:
    """``rows`` summed per token into a tensor like ``like`` ``(T, D)``, in a fixed order
    (deterministic scatter-add)."""
    out = torch.zeros_like(like)
    prev = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        return out.scatter_add(0, token_of.reshape(-1, 1).expand(-1, like.shape[-1]), rows)
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn_only)


def combine(y: Tensor, routed_scores: Tensor, token_of: Tensor, x_td: Tensor) -> Tensor:
    """Each routed output scaled by its score (in fp32), summed per token in a fixed order
    (torchtitan's combine)."""
    return scatter_rows(scaled(y, routed_scores), token_of, x_td)


def expert_rows_backward(rows_x: Tensor, rows_s: Tensor, grad_rows: Tensor, counts: Tensor,
                         w1: Tensor, w2: Tensor, w3: Tensor, compute_dtype: str
                         ) -> list[Tensor]:
    """Gradients of ``scaled(expert_mlp(rows_x, counts, w...), rows_s)`` w.r.t. rows_x,
    rows_s, w1, w2, w3 given ``grad_rows``: the experts' forward re-run under autograd on
    the rows (its hidden activations are not kept), so the gradients are those of the
    model's own code. Called inside the backward op's kernel, below autograd."""
    leaves = [t.detach().requires_grad_(True) for t in (rows_x, rows_s, w1, w2, w3)]
    with compat.autograd_inside_custom_op(), torch.enable_grad():
        y = scaled(expert_mlp(leaves[0], counts, *leaves[2:], compute_dtype), leaves[1])
        grads = torch.autograd.grad(y, leaves, grad_rows, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def sort_routed(flat_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``(order, counts)``: the (token, k) rows sorted by expert (stable: in token order
    within an expert), and the rows routed to each of the ``num_experts`` experts. No host
    sync (a boolean mask or ``bincount`` would need one on CUDA)."""
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids.long(), torch.ones_like(flat_ids, dtype=torch.long))
    return order, counts


def local_rows(counts: Tensor, expert_ids: Tensor) -> tuple[int, int]:
    """(first sorted row, row count) of the rows routed to the local experts ``expert_ids``
    (a contiguous run of ids) given the per-expert ``counts``: one host sync."""
    starts = torch.cumsum(counts, 0) - counts
    lo = starts[expert_ids[:1]].sum()  # 0 when no expert is local
    lo, n = torch.stack([lo, counts[expert_ids].sum()]).tolist()
    return lo, n


def routing(order: Tensor, counts: Tensor, ids: Tensor, recv: Tensor | None = None
            ) -> tuple[Tensor, Tensor]:
    """The forward's routing as the op returns it (module docstring): ``order`` shaped like
    ``ids`` and ``counts`` ``(2, E)`` (row 1: ``recv`` flattened, when given)."""
    table = torch.zeros(2, counts.numel(), dtype=torch.long, device=counts.device)
    table[0] = counts
    if recv is not None:
        table[1, :recv.numel()] = recv.reshape(-1)
    return order.reshape(ids.shape), table


def local_backward(grad: Tensor, x: Tensor, scores: Tensor, ids: Tensor, expert_ids: Tensor,
                   w1: Tensor, w2: Tensor, w3: Tensor, order: Tensor, counts: Tensor,
                   compute_dtype: str) -> list[Tensor]:
    """Gradients (x, scores, w1, w2, w3) of the op without dispatch, from the forward's
    routing (``order``, ``counts``): one host sync (the local rows' range), no sort."""
    b, l, d = x.shape
    k = ids.shape[-1]
    lo, n = local_rows(counts[0], expert_ids)
    rows = order.reshape(-1)[lo:lo + n]
    token_of = rows // k
    x_td, g_td = x.reshape(b * l, d), grad.reshape(b * l, d)
    gx, gs, g1, g2, g3 = expert_rows_backward(
        x_td[token_of], scores.reshape(-1)[rows], g_td[token_of], counts[0][expert_ids],
        w1, w2, w3, compute_dtype)
    grad_x = scatter_rows(gx, token_of, x_td).reshape(x.shape)
    grad_s = torch.zeros_like(scores).reshape(-1).index_copy(0, rows, gs)
    return [grad_x, grad_s.reshape(scores.shape), g1, g2, g3]


# --- all-to-all dispatch ----------------------------------------------------------------------


class _Exchange:
    """The sizes of one device's all-to-all exchange, read from the device in one sync."""

    def __init__(self, counts: Tensor, send: Tensor, recv: Tensor, start: Tensor,
                 expert_ids: Tensor, rank: int, n: int, block: int):
        n_local = expert_ids.numel()
        first = expert_ids[0]
        leaf = first - (start + rank * block)  # the local experts' offset in this rank's block
        #: rows received for each expert of the block, all sources together (on the device)
        self.per_expert = recv.view(n, block).sum(0)
        slot = torch.arange(block, device=recv.device)
        lo = (self.per_expert * (slot < leaf)).sum()
        mine = (slot >= leaf) & (slot < leaf + n_local)
        send_lo = (torch.cumsum(counts, 0) - counts)[start.reshape(1)].sum()
        sizes = torch.cat([send.view(n, block).sum(1), recv.view(n, block).sum(1),
                           torch.stack([send_lo, lo, (self.per_expert * mine).sum(),
                                        first.long(), leaf.long()])]).tolist()
        #: rows sent to / received from each device of the group
        self.in_splits, self.out_splits = sizes[:n], sizes[n:2 * n]
        #: the first sorted row routed inside the group's range; the received rows of the
        #: local experts (expert-major) ``[lo, lo + n_mine)``; their offset in the block
        self.send_lo, self.lo, self.n_mine, first, self.leaf = sizes[2 * n:]
        if not 0 <= self.leaf <= block - n_local:
            raise ValueError(
                f"local experts {first}..{first + n_local - 1} are not in rank {rank}'s "
                f"dispatch block of {block} (experts from {first - self.leaf - rank * block}"
                "): the experts must be split over the dispatch mesh dim in mesh order")
        self.sent, self.received = sum(self.in_splits), sum(self.out_splits)


def _group_send(counts: Tensor, expert_ids: Tensor, n: int, block: int) -> tuple[Tensor, Tensor]:
    """(first expert of the range the group serves, rows this device sends to each expert
    of that range), on the device."""
    outer = n * block
    start = expert_ids[0] // outer * outer
    return start, counts[start + torch.arange(outer, device=counts.device)]


def expert_major(recv: Tensor, total: int) -> Tensor:
    """Where each of the ``total`` rows received rank-major (by source, then expert of the
    block; ``recv`` ``(n, block)`` rows each) goes in expert-major order (by expert, then
    source in rank order): a permutation, by arithmetic (no sort, no host sync)."""
    flat = recv.reshape(-1)
    chunk = torch.cumsum(flat, 0) - flat
    per_expert = recv.sum(0)
    before = torch.cumsum(recv, 0) - recv  # rows of the same expert from lower ranks
    shift = (torch.cumsum(per_expert, 0) - per_expert + before).reshape(-1) - chunk
    return (torch.arange(total, device=recv.device)
            + shift.repeat_interleave(flat, output_size=total))


def _to_expert_major(rows: Tensor, dest: Tensor) -> Tensor:
    return torch.empty_like(rows).index_copy_(0, dest, rows)


def _pack(*parts: Tensor) -> Tensor:
    """Row-aligned tensors of any dtypes as one byte tensor (one all-to-all for all)."""
    return torch.cat([p.reshape(p.shape[0], -1).contiguous().view(torch.uint8)
                      for p in parts], dim=1)


def _unpack(buf: Tensor, likes: tuple[Tensor, ...]) -> list[Tensor]:
    """The inverse of :func:`_pack`: one tensor per ``like`` (its dtype and row width, the
    row width of a 1-D ``like`` being 1), each a copy of its own (the slice of one row is
    contiguous already, but neither aligned for its dtype nor strided as the grouped matmul
    needs)."""
    out, at = [], 0
    for t in likes:
        width = (t.shape[-1] if t.dim() > 1 else 1) * t.element_size()
        part = buf[:, at:at + width].clone(memory_format=torch.contiguous_format)
        part = part.view(t.dtype)
        out.append(part if t.dim() > 1 else part.reshape(-1))
        at += width
    return out


def dispatched(x: Tensor, scores: Tensor, ids: Tensor, expert_ids: Tensor, w1: Tensor,
               w2: Tensor, w3: Tensor, num_experts: int, compute_dtype: str, group_name: str,
               block: int) -> tuple[Tensor, Tensor, Tensor]:
    """Routed experts on this device's tokens, the experts spread over a process group:
    (output, ``order``, ``counts``; module docstring).

    Rank ``r`` of the group (size ``n``) holds experts ``[start + r·block, start +
    (r+1)·block)`` at this level, where ``[start, start + n·block)`` is the range the group
    serves (the whole set, unless an outer mesh dim splits the experts too: tokens routed
    outside it are served by that dim's other devices, and the output is partial over it).
    Its local weights may be a further slice (``expert_ids``: experts split over an inner
    mesh dim, tokens whole there): rows for the other experts of its block give zeros, and
    the output is partial over that dim as well. Three all-to-alls (counts, tokens out,
    outputs back) and one host sync (every size at once).
    """
    b, l, d = x.shape
    k = ids.shape[-1]
    rank, n = compat.group_rank_size(group_name)
    if n * block > num_experts:
        raise ValueError(f"a dispatch group of {n} devices holding {block} experts each "
                         f"serves more than the {num_experts} experts")
    x_td = x.reshape(b * l, d)
    order, counts = sort_routed(ids.reshape(-1), num_experts)
    start, send = _group_send(counts, expert_ids, n, block)
    recv = compat.all_to_all(send, [block] * n, [block] * n, group_name)
    ex = _Exchange(counts, send, recv, start, expert_ids, rank, n, block)
    rows = order[ex.send_lo:ex.send_lo + ex.sent]  # routed inside the group's range
    token_of = rows // k
    received = compat.all_to_all(x_td[token_of], ex.out_splits, ex.in_splits, group_name)
    dest = expert_major(recv.view(n, block), ex.received)
    hi = ex.lo + ex.n_mine
    y_local = expert_mlp(_to_expert_major(received, dest)[ex.lo:hi],
                         ex.per_expert[ex.leaf:ex.leaf + expert_ids.numel()], w1, w2, w3,
                         compute_dtype)
    y = torch.cat([y_local.new_zeros(ex.lo, d), y_local,
                   y_local.new_zeros(ex.received - hi, d)])
    back = compat.all_to_all(y[dest], ex.in_splits, ex.out_splits, group_name)
    out = combine(back, scores.reshape(-1)[rows], token_of, x_td).reshape(b, l, d)
    return (out, *routing(order, counts, ids, recv))


def dispatched_backward(grad: Tensor, x: Tensor, scores: Tensor, ids: Tensor,
                        expert_ids: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, order: Tensor,
                        counts: Tensor, compute_dtype: str, group_name: str, block: int
                        ) -> list[Tensor]:
    """Gradients (x, scores, w1, w2, w3) of :func:`dispatched` from its routing (``order``,
    ``counts``): no sort, no count exchange, one host sync, two all-to-alls.

    Out: each routed row's token, output gradient and score, packed as bytes in one
    exchange; the expert side re-runs its experts' forward on them under autograd
    (:func:`expert_rows_backward`). Back: each row's token gradient and score gradient,
    in one exchange. The tokens travel again because the rows a device received in the
    forward are a data-dependent number, which the op cannot return (a custom op's outputs
    have static shapes; padded to the static bound, every row of the group's every token,
    they would hold ``n·K`` times the tokens) and so cannot be saved for the backward.
    """
    b, l, d = x.shape
    k = ids.shape[-1]
    rank, n = compat.group_rank_size(group_name)
    x_td, g_td, s_flat = x.reshape(b * l, d), grad.reshape(b * l, d), scores.reshape(-1)
    start, send = _group_send(counts[0], expert_ids, n, block)
    recv = counts[1, :n * block]
    ex = _Exchange(counts[0], send, recv, start, expert_ids, rank, n, block)
    rows = order.reshape(-1)[ex.send_lo:ex.send_lo + ex.sent]
    token_of = rows // k
    out = _pack(x_td[token_of], g_td[token_of], s_flat[rows])
    received = compat.all_to_all(out, ex.out_splits, ex.in_splits, group_name)
    dest = expert_major(recv.view(n, block), ex.received)
    hi = ex.lo + ex.n_mine
    rx, rg, rs = _unpack(_to_expert_major(received, dest)[ex.lo:hi], (x_td, g_td, s_flat))
    gx, gs, g1, g2, g3 = expert_rows_backward(
        rx, rs, rg, ex.per_expert[ex.leaf:ex.leaf + expert_ids.numel()], w1, w2, w3,
        compute_dtype)
    mine = _pack(gx, gs)
    width = mine.shape[1]
    full = torch.cat([mine.new_zeros(ex.lo, width), mine,
                      mine.new_zeros(ex.received - hi, width)])
    back = compat.all_to_all(full[dest], ex.in_splits, ex.out_splits, group_name)
    gx_rows, gs_rows = _unpack(back, (x_td, s_flat))
    grad_x = scatter_rows(gx_rows, token_of, x_td).reshape(x.shape)
    grad_s = torch.zeros_like(s_flat).index_copy(0, rows, gs_rows).reshape(scores.shape)
    return [grad_x, grad_s, g1, g2, g3]
