"""Attention whose scores are capped before the softmax (``s = cap * tanh(s / cap)``, Gemma 2's
logit softcapping), which no fused kernel torch drives takes: blocks of queries against every
key, forward and backward, in plain torch ops that run on every device.

The forward keeps only the output and the fp32 log-sum-exp, as the fused kernels do; the
backward recomputes each block's scores from them (FlashAttention's recurrence through the
cap's ``1 - tanh^2``), so no score tensor per head outlives a block of :func:`block_rows`
queries, priced as the op's scratch memory (:func:`scratch_bytes`). Scores and softmax are
fp32. Causal is top-left aligned, as SDPA's ``is_causal``; ``mask`` is a boolean keep-mask
``(batch or 1, 1, q, k)``. A query that attends to nothing gets a zero output and gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_BYTES = 64 * 2**20
"""Bytes of one block's fp32 score tensor that :func:`block_rows` aims at."""

FORWARD_BLOCKS = 3
"""Block-sized fp32 tensors the forward holds at once (scores, their exponent, a cast)."""

BACKWARD_BLOCKS = 6
"""Block-sized fp32 tensors the backward holds at once (tanh, P, dP, dS and temporaries)."""


def block_rows(batch: int, heads: int, q_len: int, k_len: int) -> int:
    """Queries per block: a power of two whose fp32 scores against every key take about
    :data:`BLOCK_BYTES` (at least 16 queries, at most ``q_len``)."""
    per_row = max(1, batch * heads * k_len * 4)
    rows = 16
    while rows * 2 * per_row <= BLOCK_BYTES and rows < q_len:
        rows *= 2
    return max(1, min(rows, q_len))


def _repeat(q: Tensor, t: Tensor) -> Tensor:
    groups = q.shape[1] // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(grad: Tensor, like: Tensor) -> Tensor:
    kv = like.shape[1]
    return grad if grad.shape[1] == kv else grad.unflatten(1, (kv, grad.shape[1] // kv)).sum(2)


def _scores(q: Tensor, k: Tensor, i0: int, i1: int, end: int, is_causal: bool, scale: float,
            mask: Tensor | None, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """Block ``[i0, i1)``'s capped scores against keys ``[0, end)`` (masked ones -inf), the
    ``tanh`` they came through, and the keep-mask applied (True where attended)."""
    raw = torch.matmul(q[:, :, i0:i1].float(), k[:, :, :end].float().transpose(-1, -2)) * scale
    t = torch.tanh(raw / softcap)
    keep = torch.ones(raw.shape[-2:], dtype=torch.bool, device=q.device)
    if is_causal:
        keep = torch.arange(end, device=q.device)[None, :] <= torch.arange(
            i0, i1, device=q.device)[:, None]
    keep = keep[None, None]
    if mask is not None:
        keep = keep & mask[:, :, i0:i1, :end]
    return (t * softcap).masked_fill(~keep, float("-inf")), t, keep


def _ends(q_len: int, k_len: int, rows: int, is_causal: bool):
    for i0 in range(0, q_len, rows):
        i1 = min(i0 + rows, q_len)
        yield i0, i1, (min(k_len, i1) if is_causal else k_len)


def softcap_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                    mask: Tensor | None, softcap: float) -> tuple[Tensor, Tensor]:
    """Output ``(b, h, s_q, d_v)`` in q's dtype and fp32 log-sum-exp ``(b, h, s_q)`` of
    attention with scores capped at ``softcap``."""
    k, v = _repeat(q, k), _repeat(q, v)
    b, h, s_q = q.shape[:3]
    out = q.new_zeros((b, h, s_q, v.shape[-1]))
    lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    for i0, i1, end in _ends(s_q, k.shape[2], block_rows(b, h, s_q, k.shape[2]), is_causal):
        s, _, keep = _scores(q, k, i0, i1, end, is_causal, scale, mask, softcap)
        block_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - block_lse.unsqueeze(-1)).masked_fill(~keep, 0.0)
        p = torch.nan_to_num(p, nan=0.0)  # a query that attends to nothing
        out[:, :, i0:i1] = torch.matmul(p, v[:, :, :end].float()).to(out.dtype)
        lse[:, :, i0:i1] = block_lse
    return out, lse


def softcap_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     is_causal: bool, scale: float, mask: Tensor | None, softcap: float
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k and v of :func:`softcap_forward`, from its output and log-sum-exp."""
    k_rep, v_rep = _repeat(q, k), _repeat(q, v)
    b, h, s_q = q.shape[:3]
    s_k = k_rep.shape[2]
    grad32 = grad.float()
    row_dot = (grad32 * out.float()).sum(-1)  # rowsum(dO * O): the softmax's Jacobian term
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k_rep.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v_rep.shape, dtype=torch.float32, device=q.device)
    for i0, i1, end in _ends(s_q, s_k, block_rows(b, h, s_q, s_k), is_causal):
        s, t, keep = _scores(q, k_rep, i0, i1, end, is_causal, scale, mask, softcap)
        p = torch.exp(s - lse[:, :, i0:i1].unsqueeze(-1)).masked_fill(~keep, 0.0)
        p = torch.nan_to_num(p, nan=0.0)
        g = grad32[:, :, i0:i1]
        dv[:, :, :end] += torch.matmul(p.transpose(-1, -2), g)
        dp = torch.matmul(g, v_rep[:, :, :end].float().transpose(-1, -2))
        d_raw = p * (dp - row_dot[:, :, i0:i1].unsqueeze(-1)) * (1 - t * t) * scale
        dq[:, :, i0:i1] = torch.matmul(d_raw, k_rep[:, :, :end].float())
        dk[:, :, :end] += torch.matmul(d_raw.transpose(-1, -2), q[:, :, i0:i1].float())
    return (dq.to(q.dtype), _sum_groups(dk, k).to(k.dtype), _sum_groups(dv, v).to(v.dtype))


def scratch_bytes(q_shape, k_shape, *, backward: bool) -> int:
    """Bytes the blockwise path holds inside the op beyond its inputs and outputs: its
    block-sized fp32 tensors, and in the backward the fp32 gradients it accumulates."""
    b, h, s_q, d = q_shape
    s_k = k_shape[-2]
    block = b * h * block_rows(b, h, s_q, s_k) * s_k * 4
    if not backward:
        return FORWARD_BLOCKS * block
    return BACKWARD_BLOCKS * block + 4 * b * h * (s_q + 2 * s_k) * d
