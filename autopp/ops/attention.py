"""Attention as one op in planned graphs, so planned stages run the device's fused kernel.

Traced on meta, SDPA decomposes into matmuls and a softmax, and a stage lowered from that
would run math attention and keep the probabilities. So while autopp traces a unit,
:class:`AttentionAsOneOp` routes SDPA calls (no dropout; no mask, or one boolean
``(batch, 1, q, k)`` mask per sequence, :func:`keep_mask`'s) to ``autopp::sdpa``. Its sharding
rule (DTensor's ``register_sharding``) splits batch or heads, never the sequence. Its kernel is
the fused kernel torch picks for the local shards, called through its aten entry point
(:mod:`autopp._compat.attention`) so autograd saves the output and log-sum-exp, and
``autopp::sdpa_backward`` runs that kernel's fused backward: no second forward, no seq x seq
tensor. Priced as the fused kernels run (:func:`attention_flops`): backward 2.5x forward.

Where torch picks no kernel the op drives, it runs torch's SDPA and re-runs it in the
backward, with a warning once per device and dtype. Plans cannot know that in advance
(:func:`runtime_path`), so they price the fused kernels and the warning says where not."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula

from autopp._compat import attention as fused
from autopp._compat.sharding import autograd_inside_custom_op, is_fake
from autopp.graph.recompute import save_under_selective
from autopp.ops import attention_blockwise as blockwise

logger = logging.getLogger(__name__)
_UNFUSED_LOGGED: set[tuple[str, torch.dtype, bool]] = set()


def _torch_pick(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                mask: Tensor | None) -> SDPBackend:
    """What torch's SDPA picks for these inputs (keys and values repeated per query head,
    as the op hands them to the kernels)."""
    return fused.torch_choice(q, fused._repeat_kv(q, k), fused._repeat_kv(q, v), is_causal,
                              scale, mask)


def _log_unfused(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                 mask: Tensor | None) -> None:
    """Once per (device, dtype, masked): which inputs run unfused, what torch picks and runs
    instead, and what that costs against the plan's (fused) price."""
    key = (q.device.type, q.dtype, mask is not None)
    if key in _UNFUSED_LOGGED:
        return
    _UNFUSED_LOGGED.add(key)
    pick = _torch_pick(q, k, v, is_causal, scale, mask)
    what = (f"a boolean mask {tuple(mask.shape)} (one per sequence)" if mask is not None
            else "no mask")
    instead = ("its math path (every (query, key) pair, a score tensor per head)"
               if pick == SDPBackend.MATH else
               f"{pick.name}, which autopp::sdpa does not drive"
               + (" with a mask" if mask is not None else "")
               + ", through torch's own SDPA")
    logger.warning(
        "autopp::sdpa: no fused kernel autopp drives for %s %s inputs of shape %s with %s: "
        "torch picks %s; the backward runs the forward again under autograd. Planned as "
        "the fused kernels run: this attention's backward costs %.1fx its forward, not "
        "%.1fx (autopp.ops.attention.attention_flops)",
        q.device.type, q.dtype, tuple(q.shape), what, instead,
        _BACKWARD_PER_FORWARD[_path(pick)], _BACKWARD_PER_FORWARD["fused"])


@torch.library.custom_op("autopp::sdpa", mutates_args=())
def sdpa(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
         enable_gqa: bool, mask: Tensor | None = None, softcap: float = 0.0
         ) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention, ``(batch, heads, seq, head_dim)`` layout: its output
    and the fp32 log-sum-exp ``(batch, heads, seq)`` of each query's scores, which the fused
    backward reads (nothing meaningful on the math path, where no fused kernel ran).
    ``mask``: None, or a boolean ``(batch, 1, q, k)`` mask, True where attended (one per
    sequence, every head's: :func:`keep_mask`). ``softcap`` > 0: scores capped as
    ``softcap * tanh(s / softcap)`` before the softmax, computed blockwise
    (:mod:`autopp.ops.attention_blockwise`; no fused kernel takes it).

    The output is contiguous, as the fake kernel promises (the fused kernels return other
    strides for transposed inputs; Inductor checks the promise)."""
    if softcap > 0:
        out, lse = blockwise.softcap_forward(q, k, v, is_causal, scale, mask, softcap)
        return out.contiguous(), lse
    got = fused.fused_forward(q, k, v, is_causal, scale, mask)
    if got is None:
        _log_unfused(q, k, v, is_causal, scale, mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.contiguous(), q.new_zeros(q.shape[:3], dtype=fused.LSE_DTYPE)
    out, lse = got
    return out.contiguous(), lse.contiguous()


@sdpa.register_fake
def _(q, k, v, is_causal, scale, enable_gqa, mask=None, softcap=0.0):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:3], dtype=fused.LSE_DTYPE))


# selective recompute saves attention's output rather than running attention a third time
save_under_selective(torch.ops.autopp.sdpa)


@torch.library.custom_op("autopp::sdpa_backward", mutates_args=())
def sdpa_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  is_causal: bool, scale: float, enable_gqa: bool, mask: Tensor | None = None,
                  softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`sdpa` w.r.t. q, k, v, by the fused backward of the kernel the
    forward ran, from the forward's saved output ``out`` and log-sum-exp ``lse``.

    Where no fused kernel applies, autograd is switched back on inside the op
    (:func:`~autopp._compat.sharding.autograd_inside_custom_op`) to re-run torch's own SDPA
    forward and backward on the local shards."""
    if softcap > 0:
        grads = blockwise.softcap_backward(grad, q, k, v, out, lse, is_causal, scale, mask,
                                           softcap)
    else:
        grads = fused.fused_backward(grad, q, k, v, out, lse, is_causal, scale, mask)
    if grads is None:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with autograd_inside_custom_op(), torch.enable_grad():
            again = F.scaled_dot_product_attention(*leaves, attn_mask=mask,
                                                   is_causal=is_causal, scale=scale,
                                                   enable_gqa=enable_gqa)
            grads = torch.autograd.grad(again, leaves, grad)
    # each gradient laid out like its input, as the fake kernel promises
    return tuple(torch.empty_like(t).copy_(d) for t, d in zip((q, k, v), grads))


@sdpa_backward.register_fake
def _(grad, q, k, v, out, lse, is_causal, scale, enable_gqa, mask=None, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, is_causal, scale, enable_gqa, *rest = inputs
    mask = rest[0] if rest else None
    softcap = rest[1] if len(rest) > 1 else 0.0
    out, lse = output
    ctx.mark_non_differentiable(lse)  # statistics for the backward, not a value to train
    ctx.set_materialize_grads(False)  # no zeros made for the log-sum-exp's gradient
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.args = (is_causal, scale, enable_gqa)
    ctx.softcap = softcap


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    if grad is None:  # the output is not used (only reachable through its statistics)
        return None, None, None, None, None, None, None, None
    dq, dk, dv = sdpa_backward(grad, q, k, v, out, lse, *ctx.args, mask, ctx.softcap)
    return dq, dk, dv, None, None, None, None, None


sdpa.register_autograd(_backward, setup_context=_setup)


def _split_batch_or_heads(n_tensors_out: int, n_tensors_in: int, mask: Any):
    """Per mesh dim: everything replicated, or batch (dim 0) / heads (dim 1) split alike;
    a mask (one per sequence) split with the batch and whole over heads. Input placements
    are listed for the tensor arguments in order (DTensor pairs them with those)."""
    rules = []
    for p in (Replicate(), Shard(0), Shard(1)):
        on_mask = [] if mask is None else [Replicate() if p == Shard(1) else p]
        rules.append(([p] * n_tensors_out, [p] * n_tensors_in + on_mask + [None] * 4))
    return rules


@register_sharding(torch.ops.autopp.sdpa.default)
def _sdpa_sharding(q, k, v, is_causal, scale, enable_gqa, mask=None, softcap=0.0):
    return _split_batch_or_heads(2, 3, mask)  # output and log-sum-exp: (batch, heads, ...)


@register_sharding(torch.ops.autopp.sdpa_backward.default)
def _sdpa_backward_sharding(grad, q, k, v, out, lse, is_causal, scale, enable_gqa, mask=None,
                            softcap=0.0):
    return _split_batch_or_heads(3, 6, mask)


def attended_pairs(lq: int, lk: int, is_causal: bool) -> int:
    """(query, key) pairs attention computes: all ``lq * lk``, or under torch's causal mask
    (top-left aligned: query i sees keys 0..i) ``sum(min(i + 1, lk))``, about half: the
    fused kernels skip the masked blocks."""
    if not is_causal:
        return lq * lk
    if lq <= lk:
        return lq * (lq + 1) // 2
    return lk * (lk + 1) // 2 + (lq - lk) * lk


_BACKWARD_PER_FORWARD = {"fused": 2.5, "math": 3.0, "torch_fused": 3.5}
"""Backward FLOPs per forward FLOP on each path: the op's fused backward runs five matmuls
(q·kᵀ again, dV, dP, dQ, dK) against the forward's two; where the op falls back, its
backward runs the forward again (two) and then torch's backward: the math path's four
matmuls, or the fused kernel's five."""

BACKWARD_FLOPS_PER_FORWARD = _BACKWARD_PER_FORWARD["fused"]
"""The fused backward's FLOPs per forward FLOP: five matmuls against the forward's two."""


def _path(pick: SDPBackend | None) -> str:
    """The path a fallback runs, by torch's pick: its math path or its own fused kernel."""
    return "math" if pick in (None, SDPBackend.MATH) else "torch_fused"


def attention_flops(q_shape, k_shape, v_shape, is_causal: bool, *, backward: bool = False,
                    path: str = "fused") -> int:
    """FLOPs of attention's forward (or ``backward``) on ``path``, the one home of the
    attention FLOP rule (the registered formulas, which the planner's cost model reads,
    call it):

    * "fused": the kernels the op drives (what the planner prices), and the blockwise path
      of capped scores (:mod:`autopp.ops.attention_blockwise`, the same five matmuls): the
      (query, key) pairs they compute (:func:`attended_pairs`: causal blocks skipped),
      backward 2.5 forwards;
    * "math": the op's fallback on torch's math path: every pair (the causal mask is
      applied to a full score matrix), the backward re-running the forward: 3 forwards;
    * "torch_fused": the fallback where torch's own SDPA runs a fused kernel the op does
      not drive (cuDNN for a masked call): pairs as the fused kernels, backward 3.5
      forwards (the forward again, then the kernel's backward)."""
    b, h, lq, d = q_shape
    lk, dv = k_shape[-2], v_shape[-1]
    pairs = lq * lk if path == "math" else attended_pairs(lq, lk, is_causal)
    forward = 2 * b * h * pairs * (d + dv)  # q·kᵀ and p·v
    return int(_BACKWARD_PER_FORWARD[path] * forward) if backward else forward


def runtime_path(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                 mask: Tensor | None) -> str:
    """The path the op runs on these tensors ("fused", "math" or "torch_fused"), where it
    can be known: on real tensors (a FLOP count of a run). On meta and fake tensors (the
    planner's) it is "fused": torch makes its choice when the op runs, on the real local
    tensors (the device and its architecture, dtype, head dim, strides and alignment, the
    ``sdpa_kernel`` context then active), which a plan made on meta, possibly on a host
    without that device, cannot evaluate. A run that falls back logs it once
    (:func:`sdpa`). DTensors are judged by their local tensors (what the op runs on);
    other tensor subclasses (functional, fake) as "fused"."""
    q, k, v, mask = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k, v, mask))
    if q.device.type == "meta" or is_fake(q) or type(q) is not Tensor:
        return "fused"
    pick = _torch_pick(q, k, v, is_causal, scale, mask)
    if fused.driven_backend(q.device.type, pick, mask is not None) is not None:
        return "fused"
    return _path(pick)


@register_flop_formula(torch.ops.autopp.sdpa, get_raw=True)
def _sdpa_flop(q, k, v, is_causal, scale, enable_gqa, mask=None, softcap=0.0, *args,
               **kwargs) -> int:
    path = "fused" if softcap > 0 else runtime_path(q, k, v, is_causal, scale, mask)
    return attention_flops(q.shape, k.shape, v.shape, is_causal, path=path)


@register_flop_formula(torch.ops.autopp.sdpa_backward, get_raw=True)
def _sdpa_backward_flop(grad, q, k, v, out, lse, is_causal, scale, enable_gqa, mask=None,
                        softcap=0.0, *args, **kwargs) -> int:
    path = "fused" if softcap > 0 else runtime_path(q, k, v, is_causal, scale, mask)
    return attention_flops(q.shape, k.shape, v.shape, is_causal, backward=True, path=path)


def packed_documents(position_ids: Tensor) -> Tensor:
    """Document index of every token of packed rows ``(batch, seq)``: a document starts
    wherever a position does not follow the one before it by 1 (positions restart at each
    document, as transformers' packed-sequence rule and torchtitan's per-document positions
    have it). ``[[0, 1, 2, 0, 1, 0]]`` gives ``[[0, 0, 0, 1, 1, 2]]``."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def keep_mask(q_len: int, k_len: int, *, device: torch.device, causal: bool = True,
              key_valid: Tensor | None = None, documents: Tensor | None = None,
              window: int | None = None) -> Tensor | None:
    """Which (query, key) pairs attention uses, as one boolean mask per sequence shared by
    every head: ``(batch or 1, 1, q_len, k_len)``, True where attended; None when nothing
    is masked beyond ``causal`` (run the fused causal kernel instead).

    Args:
        causal: keys after the query are masked (aligned at the end: query ``i`` of
            ``q_len`` sees keys up to ``i + k_len - q_len``).
        key_valid: ``(batch, >= k_len)`` padding mask, nonzero for real tokens: padding
            keys are masked (padding queries still attend; their targets are ignored).
        documents: ``(batch, seq)`` document index per token (:func:`packed_documents`;
            needs ``q_len == k_len == seq``): a token attends to its own document only.
        window: a sliding window as transformers draws it: causal, keys less than
            ``window`` positions back (itself included); else at most ``window`` away.

    The mask holds ``q_len * k_len`` bytes per sequence, never one per head."""
    if window is not None and window >= k_len + (0 if causal else q_len):
        window = None
    if key_valid is None and documents is None and window is None:
        return None
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    mask = mask.tril(k_len - q_len) if causal else mask
    if window is not None and causal:
        mask = mask.triu(k_len - q_len - window + 1)
    elif window is not None:  # bidirectional: keys at most `window` positions away
        mask = mask.triu(k_len - q_len - window).tril(k_len - q_len + window)
    mask = mask[None, None]
    if key_valid is not None:
        mask = mask & key_valid.to(torch.bool)[:, None, None, :k_len]
    if documents is not None:
        if not q_len == k_len == documents.shape[-1]:
            raise ValueError(f"document masks need queries and keys of the packed rows' "
                             f"length {documents.shape[-1]}, got {q_len} and {k_len}")
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    return mask


class AttentionAsOneOp(TorchFunctionMode):
    """While active, SDPA calls without dropout, with no mask or one boolean mask per
    sequence (``(batch, 1, q, k)``), become ``autopp::sdpa``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _as_sdpa(*args, **kwargs)
            if call is not None:
                return torch.ops.autopp.sdpa(*call)[0]
        return func(*args, **kwargs)


def _as_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False) -> tuple[Any, ...] | None:
    if dropout_p != 0.0 or not (attn_mask is None or _per_sequence(attn_mask, q, k)):
        return None
    return q, k, v, bool(is_causal), float(scale if scale is not None else q.shape[-1] ** -0.5), \
        bool(enable_gqa), attn_mask


def _per_sequence(mask: Tensor, q: Tensor, k: Tensor) -> bool:
    """A boolean mask shared by every head, one per sequence: ``(batch, 1, q, k)``."""
    return (mask.dtype == torch.bool and mask.dim() == 4
            and tuple(mask.shape) == (q.shape[0], 1, q.shape[2], k.shape[2]))

