"""The local kernels of routed experts, called by the op (:mod:`autopp.ops.experts`): the
grouped SwiGLU MLP over tokens sorted by expert, the score-weighted combine, and the
all-to-all token exchange (:func:`dispatched`) whose planner side is
:mod:`autopp.sharding.expert_dispatch`."""

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


def combine(y: Tensor, routed_scores: Tensor, token_of: Tensor, x_td: Tensor) -> Tensor:
    """Each routed output scaled by its score (in fp32), summed per token in a fixed order
    (torchtitan's combine)."""
    d = x_td.shape[-1]
    y = (y.to(torch.float32) * routed_scores.reshape(-1, 1)).to(y.dtype)
    out = torch.zeros_like(x_td)
    prev = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        return out.scatter_add(0, token_of.reshape(-1, 1).expand(-1, d), y)
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn_only)


def dispatched(x: Tensor, scores: Tensor, ids: Tensor, expert_ids: Tensor, w1: Tensor,
               w2: Tensor, w3: Tensor, compute_dtype: str, group_name: str,
               block: int) -> Tensor:
    """Routed experts on this device's tokens, the experts spread over a process group.

    Rank ``r`` of the group (size ``n``) holds experts ``[start + r·block, start +
    (r+1)·block)`` at this level, where ``[start, start + n·block)`` is the range the group
    serves (the whole set, unless an outer mesh dim splits the experts too: tokens routed
    outside it are served by that dim's other devices, and the output is partial over it).
    Its local weights may be a further slice (``expert_ids``: experts split over an inner
    mesh dim, tokens whole there): rows for the other experts of its block give zeros, and
    the output is partial over that dim as well. Differentiable in x, scores and weights.
    """
    b, l, d = x.shape
    k = ids.shape[-1]
    rank, n = compat.group_rank_size(group_name)
    x_td, flat = x.reshape(b * l, d), ids.reshape(-1)
    n_local = expert_ids.numel()
    outer = block * n
    # every index computed on the device; one host sync below reads all the sizes at once
    first = expert_ids[0]
    start = first // outer * outer
    leaf = first - (start + rank * block)  # the local experts' offset in this rank's block
    order, send_counts = sort_routed(flat, start, outer)
    recv_counts = compat.all_to_all(send_counts, [block] * n, [block] * n, group_name)
    per_expert = recv_counts.view(n, block).sum(0)
    slot = torch.arange(block, device=x.device)
    lo = (per_expert * (slot < leaf)).sum()
    mine = (slot >= leaf) & (slot < leaf + n_local)
    sizes = torch.cat([send_counts.view(n, block).sum(1), recv_counts.view(n, block).sum(1),
                       torch.stack([lo, (per_expert * mine).sum(), first.long(), leaf.long()])
                       ]).tolist()
    in_splits, out_splits = sizes[:n], sizes[n:2 * n]
    lo, n_mine, first, leaf = sizes[2 * n:]
    if not 0 <= leaf <= block - n_local:
        raise ValueError(f"local experts {first}..{first + n_local - 1} are not in rank "
                         f"{rank}'s dispatch block of {block} (experts from "
                         f"{first - leaf - rank * block}): the experts must be split over the "
                         "dispatch mesh dim in mesh order")
    order = order[:sum(in_splits)]  # the rows routed inside this group's range, by expert
    token_of = order // k
    received = compat.all_to_all(x_td[token_of], out_splits, in_splits, group_name)
    # rank-major (source, expert) -> expert-major (expert, source), sources in rank order
    expert_of_row = slot.repeat(n).repeat_interleave(recv_counts, output_size=sum(out_splits))
    perm = torch.argsort(expert_of_row, stable=True)
    hi = lo + n_mine
    routed = received[perm]
    y_local = expert_mlp(routed[lo:hi], per_expert[leaf : leaf + n_local], w1, w2, w3,
                         compute_dtype)
    y = torch.cat([y_local.new_zeros(lo, d), y_local,
                   y_local.new_zeros(routed.shape[0] - hi, d)])
    back = compat.all_to_all(y[torch.argsort(perm)], in_splits, out_splits, group_name)
    return combine(back, scores.reshape(-1)[order], token_of, x_td).reshape(b, l, d)


def sort_routed(flat_ids: Tensor, start: Tensor | int, span: int) -> tuple[Tensor, Tensor]:
    """``(order, counts)``: the (token, k) rows sorted by expert, those routed to experts
    ``[start, start + span)`` first (stable: in token order within an expert) and the others
    after them; and the rows routed to each of those experts. No host sync (a boolean mask
    or ``bincount`` would need one on CUDA)."""
    inside = (flat_ids >= start) & (flat_ids < start + span)
    key = torch.where(inside, flat_ids - start, span)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(span + 1, dtype=torch.long, device=flat_ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return order, counts[:span]
