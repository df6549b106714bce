"""torchtitan's mixture-of-experts layers (``torchtitan.models.common.moe``) for the planner.

What autopp needs to know about them, and nothing else does:

* **Routed experts trace as one op.** ``RoutedExperts.forward`` (token dispatch, torchtitan's
  bf16 ``GroupedExperts``, combine) becomes ``autopp::routed_experts`` with the same
  numerics (:mod:`autopp.sharding.experts`); its sharding rule lets the planner put experts
  over any mesh dims. The router, the shared experts and the load-balancing count stay the
  model's own code and plan op by op.
* **The router's autocast on meta.** ``TokenChoiceTopKRouter`` opens
  ``torch.autocast(device_type=x.device.type, dtype=float32)``, which torch refuses for
  "meta"; on meta it is opened disabled (on CPU, float32 autocast is disabled too).
* **Load balancing.** ``MoE.forward`` adds each microbatch's tokens per expert to the
  ``tokens_per_expert_E`` buffer (a buffer update the planned graphs carry out, see
  :mod:`autopp.sharding.trace`); once per step, before the optimizer, each MoE layer's
  ``expert_bias_E`` moves by ``coeff * sign(mean - count)`` (centred) and the count is reset
  (auxiliary-loss-free balancing, arXiv:2408.15664; torchtitan does this in an optimizer
  pre-hook that walks ``model.layers``, which a pipeline stage does not have whole).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


_COMPUTE_DTYPE: torch.dtype | None = torch.bfloat16


def set_expert_compute_dtype(dtype: torch.dtype | None) -> None:
    """The dtype autopp's planned stages compute routed experts in: ``torch.bfloat16``
    (default, what torchtitan's ``GroupedExperts`` does whatever the parameters' dtype) or
    ``None`` for the parameters' own dtype (e.g. fp32 numerics to compare against a
    single-process fp32 reference: bf16 partial sums over different token subsets round
    differently). Applies to stages traced after the call, in this process."""
    global _COMPUTE_DTYPE
    _COMPUTE_DTYPE = dtype


def _moe_classes():
    try:
        from torchtitan.models.common import moe
    except ImportError:  # torchtitan is optional
        return None
    return moe


def _routed_forward(moe):
    base = moe.GroupedExperts

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                num_local_tokens_per_expert_E):
        experts = self.inner_experts
        if (type(experts).forward is not base.forward
                or type(experts)._grouped_mm is not base._grouped_mm):
            raise NotImplementedError(
                f"{type(experts).__name__} overrides GroupedExperts' computation (e.g. a "
                "low-precision converter); autopp plans routed experts as torchtitan's bf16 "
                "GroupedExperts only. Plan this model without the converter.")
        dispatcher = self.token_dispatcher
        if getattr(dispatcher, "non_blocking_capacity_factor", None) is not None:
            raise NotImplementedError(
                "token dropping (non_blocking_capacity_factor) is not planned; autopp runs "
                "every routed token (set non_blocking_capacity_factor=None)")
        n = experts.num_experts
        expert_ids = torch.arange(n, device=x_BLD.device)
        return torch.ops.autopp.routed_experts(
            x_BLD, topk_scores_BLK, topk_expert_ids_BLK, expert_ids, experts.w1_EFD,
            experts.w2_EDF, experts.w3_EFD, n,
            "" if _COMPUTE_DTYPE is None else str(_COMPUTE_DTYPE).removeprefix("torch."))

    return forward


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Routed experts as ``autopp::routed_experts`` and autocast allowed on meta."""
    moe = _moe_classes()
    if moe is None:
        yield
        return
    import autopp.sharding.experts  # noqa: F401  (registers the op)

    original_forward = moe.RoutedExperts.forward
    original_autocast = torch.autocast.__init__

    def autocast_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "meta":
            device_type, enabled = "cpu", False
        original_autocast(self, device_type, dtype=dtype, enabled=enabled,
                          cache_enabled=cache_enabled)

    moe.RoutedExperts.forward = _routed_forward(moe)
    torch.autocast.__init__ = autocast_init
    try:
        yield
    finally:
        moe.RoutedExperts.forward = original_forward
        torch.autocast.__init__ = original_autocast


def moe_layers(modules: list[nn.Module]) -> list[nn.Module]:
    """The torchtitan ``MoE`` layers held by ``modules``."""
    moe = _moe_classes()
    if moe is None:
        return []
    return [m for root in modules for m in root.modules() if isinstance(m, moe.MoE)]


@contextlib.contextmanager
def counts_kept(modules: list[nn.Module]) -> Iterator[None]:
    """The MoE layers' token counts as they were on entry, restored on exit."""
    layers = moe_layers(modules)
    saved = [layer.tokens_per_expert_E.detach().clone() for layer in layers]
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, value in zip(layers, saved):
                layer.tokens_per_expert_E.copy_(value)


@torch.no_grad()
def update_expert_bias(modules: list[nn.Module]) -> None:
    """One load-balancing update per MoE layer with a ``load_balance_coeff``: move the
    expert bias towards the under-used experts by the sign of (mean count - count),
    centred, and reset the count. The counts are the whole step's (every microbatch, every
    dp rank): the planned graphs sum them into a replicated buffer."""
    for layer in moe_layers(modules):
        coeff = layer.load_balance_coeff
        if coeff is None or layer.expert_bias_E is None:
            continue
        counts = layer.tokens_per_expert_E.float()
        delta = coeff * torch.sign(counts.mean() - counts)
        layer.expert_bias_E.add_(delta - delta.mean())
        layer.tokens_per_expert_E.zero_()
