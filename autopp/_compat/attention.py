"""The fused SDPA kernels' private aten entry points, forward and backward, one pair per
backend (CPU flash; CUDA flash, memory-efficient, cuDNN): what ``autopp::sdpa``
(:mod:`autopp.ops.attention`) calls so that its forward keeps the output and log-sum-exp
its backward reads and the backward never re-runs the forward (as torch's SDPA autograd).

The backend is the one torch would pick for ``F.scaled_dot_product_attention`` on the same
inputs (:func:`torch_choice`, honouring ``sdpa_kernel``); where it picks none this module
drives, :func:`fused_forward` returns None and the op runs torch's own SDPA. Invariants:
every log-sum-exp is handed out as ``(b, h, s_q)`` fp32 (:data:`LSE_DTYPE`) and given back in
its kernel's shape; no dropout, so the backwards' random state is never read; grouped-query
keys and values are repeated per query head and their gradients summed back per group; a
boolean mask reaches each kernel as torch's own SDPA would hand it (:func:`additive_mask`,
:func:`efficient_bias`). The CPU pair is checked against torch's SDPA in the test suite, the
CUDA pairs by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

LSE_DTYPE = torch.float32
"""dtype of the log-sum-exp every fused kernel keeps for its backward."""

_aten = torch.ops.aten


def _repeat_kv(q: Tensor, t: Tensor) -> Tensor:
    """Keys or values repeated per query head (grouped-query attention), as torch's math
    path repeats them; ``t`` itself when the head counts agree."""
    groups = q.shape[1] // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(grad: Tensor, like: Tensor) -> Tensor:
    """A repeated key's or value's gradient summed back over its query-head group."""
    kv_heads = like.shape[1]
    if grad.shape[1] == kv_heads:
        return grad
    return grad.unflatten(1, (kv_heads, grad.shape[1] // kv_heads)).sum(2)


def additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean keep-mask as the additive mask torch's SDPA hands its kernels."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask.logical_not(), float("-inf"))


BIAS_ALIGNMENT = 16
"""Elements each row of the memory-efficient kernel's additive bias is aligned to (a multiple
of the kernel's own alignment, 16 bytes, for every dtype it takes)."""


def efficient_bias(mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """A boolean keep-mask ``(b, 1, s_q, s_k)`` as the CUDA memory-efficient kernel takes it
    (aten's ``preprocess_mask``): additive, in q's dtype, each row in storage of
    ``⌈s_k/16⌉·16`` elements (sliced back to ``s_k``), expanded over heads without a copy to
    ``(b, h, s_q, s_k)``."""
    s_k = mask.shape[-1]
    aligned = -(-s_k // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    bias = torch.zeros((*mask.shape[:-1], aligned), dtype=q.dtype, device=mask.device)
    bias = bias[..., :s_k].masked_fill_(mask.logical_not(), float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def torch_choice(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                 mask: Tensor | None = None) -> SDPBackend:
    """The backend torch's SDPA picks for these (equal-head) inputs (its math path
    included), honouring ``torch.nn.attention.sdpa_kernel``."""
    return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=scale))


def driven_backend(device_type: str, backend: SDPBackend, masked: bool) -> SDPBackend | None:
    """``backend`` (torch's pick) where this module drives it on ``device_type``, else None:
    CPU flash; on CUDA flash, memory-efficient and cuDNN, with a mask memory-efficient only
    (torch picks no flash kernel for a mask; cuDNN's bias path is not driven)."""
    if device_type == "cpu":
        return backend if backend == SDPBackend.FLASH_ATTENTION else None
    if device_type != "cuda":
        return None
    driven = ((SDPBackend.EFFICIENT_ATTENTION,) if masked else
              (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.CUDNN_ATTENTION))
    return backend if backend in driven else None


def fused_backend(q: Tensor, k: Tensor, v: Tensor, is_causal: bool,
                  scale: float, mask: Tensor | None = None) -> SDPBackend | None:
    """The fused backend torch picks for these (equal-head) inputs, None for its math path
    or a backend this module does not drive (:func:`driven_backend`). Where torch picks
    cuDNN for a masked CUDA call, it is asked again with memory-efficient attention alone
    (when that backend is enabled): the efficient kernel with torch's bias, if torch would
    run it on these inputs, rather than torch's own SDPA re-running the forward."""
    pick = torch_choice(q, k, v, is_causal, scale, mask)
    if (mask is not None and q.device.type == "cuda" and pick == SDPBackend.CUDNN_ATTENTION
            and torch.backends.cuda.mem_efficient_sdp_enabled()):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            pick = torch_choice(q, k, v, is_causal, scale, mask)
    return driven_backend(q.device.type, pick, mask is not None)


# The pairs driven, and each kernel's own log-sum-exp shape (given back in it):
#   CPU flash       _scaled_dot_product_flash_attention_for_cpu   (b, h, s_q)          mask: yes
#   CUDA flash      _scaled_dot_product_flash_attention            (b, h, s_q)          mask: no (1)
#   CUDA efficient  _scaled_dot_product_efficient_attention        (b, h, ceil(s_q/32)*32)  yes (2)
#   CUDA cuDNN      _scaled_dot_product_cudnn_attention            (b, h, s_q, 1)       mask: no (3)
# (1) torch picks no flash kernel for a masked call (flash takes no mask).
# (2) the bias as aten's preprocess_mask makes it (efficient_bias); its backward gets the same
#     bias, made again from the saved boolean mask, and computes no bias gradient.
# (3) cuDNN's bias path is not driven: its convert_boolean_attn_mask_cudnn fills with -65504,
#     not -inf (in the aten source read). torch may pick cuDNN for a masked call on sm90 /
#     sm10x with a recent cuDNN: fused_backend then asks for memory-efficient attention.
# The random state the backwards take is passed as the forwards return it when not capturing
# a CUDA graph (host tensors of the forwards' shapes); dropout is 0, so it is never read.


def fused_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool,
                  scale: float, mask: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """``(output, log-sum-exp)`` of causal or full attention (under ``mask``, a boolean
    ``(b, 1, s_q, s_k)`` keep-mask, when given) by the fused kernel torch picks; None where
    it would pick none (the caller then runs torch's own SDPA)."""
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    backend = fused_backend(q, k, v, is_causal, scale, mask)
    b, h, s = q.shape[:3]
    if backend is None:
        return None
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=additive_mask(mask, q.dtype), scale=scale)
    elif backend == SDPBackend.FLASH_ATTENTION:
        out, lse = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    elif backend == SDPBackend.EFFICIENT_ATTENTION:
        bias = None if mask is None else efficient_bias(mask, q, k)
        out, lse = _aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, is_causal, scale=scale)[:2]
    else:
        out, lse = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale)[:2]
    return out, lse.reshape(b, h, -1)[..., :s].to(LSE_DTYPE)


def _host_scalars(dtype: torch.dtype, seed_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    return (torch.zeros(seed_shape, dtype=dtype), torch.zeros((), dtype=dtype))


def fused_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   is_causal: bool, scale: float, mask: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor] | None:
    """Gradients of q, k and v by the backward of the kernel :func:`fused_forward` ran
    (the same choice, made again on the same inputs), from its output and log-sum-exp;
    None where no fused kernel applies."""
    k_rep, v_rep = _repeat_kv(q, k), _repeat_kv(q, v)
    backend = fused_backend(q, k_rep, v_rep, is_causal, scale, mask)
    if backend is None:
        return None
    b, h, s = q.shape[:3]
    grad = grad.contiguous()  # laid out as the saved output is (contiguous)
    if q.device.type == "cpu":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k_rep, v_rep, out, lse, 0.0, is_causal,
            attn_mask=additive_mask(mask, q.dtype), scale=scale)
    elif backend == SDPBackend.FLASH_ATTENTION:
        seed, offset = _host_scalars(torch.uint64, (2,))
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            grad, q, k_rep, v_rep, out, lse, None, None, s, k.shape[2], 0.0, is_causal,
            seed, offset, scale=scale)
    elif backend == SDPBackend.EFFICIENT_ATTENTION:
        padded = lse.new_zeros(b, h, math.ceil(s / 32) * 32)
        padded[..., :s] = lse
        seed, offset = _host_scalars(torch.int64, ())
        bias = None if mask is None else efficient_bias(mask, q, k_rep)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k_rep, v_rep, bias, out, padded, seed, offset, 0.0,
            [True, True, True, False], is_causal, scale=scale)
    else:
        seed, offset = _host_scalars(torch.int64, ())
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k_rep, v_rep, out, lse.unsqueeze(-1), seed, offset, None, None, None,
            s, k.shape[2], 0.0, is_causal, scale=scale)
    return dq, _sum_groups(dk, k), _sum_groups(dv, v)
