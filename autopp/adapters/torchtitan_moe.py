"""torchtitan's mixture-of-experts layers (``torchtitan.models.common.moe``) for the planner.

* **Routed experts trace as one op.** ``RoutedExperts.forward`` (dispatch, the bf16
  ``GroupedExperts``, combine) becomes ``autopp::routed_experts`` with the same numerics
  (:mod:`autopp.ops.experts`), sharded over any mesh dims; the router, shared experts and
  load count stay the model's own code, planned op by op.
* **The router's autocast on meta**, which torch refuses, is opened disabled
  (:func:`tracing_context`; float32 autocast is disabled on CPU too).
* **Load balancing** (auxiliary-loss-free, arXiv:2408.15664): ``MoE.forward`` adds each
  microbatch's tokens per expert to ``tokens_per_expert_E`` (a buffer update the planned
  graphs carry, :mod:`autopp.tracing.joint`); once per step :func:`update_expert_bias` moves
  each layer's ``expert_bias_E`` and resets the count. torchtitan does it in an optimizer
  pre-hook that walks ``model.layers``, which a pipeline stage does not hold whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from autopp import tracing
from autopp.adapters.adapter import Adapter, register
from autopp.ops import DISPATCHES, EXPERT_DIMS


# Tracing settings (autopp.tracing): planner options (``PlannerOptions.token_dispatch``,
# ``expert_dims``, ``expert_compute_dtype``, ``expert_imbalance``) that a plan
# records and every trace (and pricing) of its stages uses; set_token_dispatch below changes
# the dispatch's process-wide default.
tracing.declare("expert_compute_dtype", "bfloat16", ("bfloat16", "float16", "float32", "param"))
tracing.declare("token_dispatch", "auto", DISPATCHES)
tracing.declare("expert_dims", "auto", EXPERT_DIMS)
EXPERT_IMBALANCES = ("1", "1.1", "1.2", "1.25", "1.3", "1.5", "1.75", "2", "2.5", "3", "4")
"""The busiest expert-parallel device's routed tokens over the mean the planner can price
(:mod:`autopp.sharding.options.expert_dispatch`); "1": uniform routing."""
tracing.declare("expert_imbalance", "1", EXPERT_IMBALANCES)


def expert_compute_dtype() -> torch.dtype | None:
    """The current expert compute dtype (None: the parameters' own)."""
    name = tracing.setting("expert_compute_dtype")
    return None if name == "param" else getattr(torch, name)


def set_token_dispatch(mode: str) -> None:
    """The default of ``PlannerOptions.token_dispatch`` (an alias kept for scripts written
    before it was a planner option): how autopp's planned stages may bring tokens to
    expert-parallel devices: "auto" (default: the planner prices every way and picks),
    "all_to_all" (expert parallel as torchtitan's EP: the experts split over one mesh dim,
    the planner picks which, and each token sent only to the devices holding its experts,
    as torchtitan's ``AllToAllTokenDispatcher``) or "all_gather" (never all-to-all: when
    experts are split, every device of their mesh dim gets every token; cheaper while the
    expert-parallel degree is below top-k). Applies to options made after the call, and to
    traces outside any plan, in this process."""
    tracing.set_default("token_dispatch", mode)


def token_dispatch() -> str:
    """The current token dispatch (the innermost plan's, else the process default)."""
    return tracing.setting("token_dispatch")


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
        dtype = tracing.setting("expert_compute_dtype")
        return torch.ops.autopp.routed_experts(
            x_BLD, topk_scores_BLK, topk_expert_ids_BLK, expert_ids, experts.w1_EFD,
            experts.w2_EDF, experts.w3_EFD, n, "" if dtype == "param" else dtype,
            tracing.setting("token_dispatch"))[0]  # [1:]: the routing its backward reuses

    return forward


@contextlib.contextmanager
def tracing_context() -> Iterator[None]:
    """Routed experts as ``autopp::routed_experts`` and autocast allowed on meta."""
    moe = _moe_classes()
    if moe is None:
        yield
        return
    import autopp.ops.experts  # noqa: F401  (registers the op)

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


def moe_layers(structure: list[nn.Module], state: nn.Module) -> list[tuple[nn.Module, str]]:
    """(torchtitan ``MoE`` layer, its FQN) for every MoE layer of ``structure`` (a rank's
    stage modules, whole-model FQNs) whose buffers ``state`` holds."""
    moe = _moe_classes()
    if moe is None:
        return []
    have = {name for name, _ in state.named_buffers()}
    return [(m, name) for root in structure for name, m in root.named_modules()
            if isinstance(m, moe.MoE) and f"{name}.tokens_per_expert_E" in have]


def idle_parameters(model: nn.Module) -> float:
    """Routed-expert parameters a token does not use, on average: each MoE layer's experts
    times (1 - top_k / num_experts)."""
    moe = _moe_classes()
    if moe is None:
        return 0.0
    idle = 0.0
    for m in model.modules():
        if isinstance(m, moe.MoE):
            experts = m.routed_experts.inner_experts
            n = sum(p.numel() for p in experts.parameters())
            idle += n * (1 - m.router.top_k / experts.num_experts)
    return idle


@contextlib.contextmanager
def counts_kept(structure: list[nn.Module], state: nn.Module) -> Iterator[None]:
    """The MoE layers' token counts as they were on entry, restored on exit."""
    counts = [state.get_buffer(f"{name}.tokens_per_expert_E")
              for _, name in moe_layers(structure, state)]
    saved = [c.detach().clone() for c in counts]
    try:
        yield
    finally:
        with torch.no_grad():
            for c, value in zip(counts, saved):
                c.copy_(value)


@torch.no_grad()
def update_expert_bias(structure: list[nn.Module], state: nn.Module,
                       partial_over: dist.ProcessGroup | None = None) -> None:
    """One load-balancing update per MoE layer with a ``load_balance_coeff``: move the
    expert bias towards the under-used experts by the sign of (mean count - count),
    centred, and reset the count. The counts must be the whole step's (every microbatch,
    every dp rank): planned graphs sum them into the buffer in its planned placement;
    modules run as written count their own batch slice, summed here over ``partial_over``."""
    for layer, name in moe_layers(structure, state):
        counts = state.get_buffer(f"{name}.tokens_per_expert_E")
        if layer.load_balance_coeff is None:
            counts.zero_()
            continue
        if partial_over is not None:
            dist.all_reduce(counts, group=partial_over)
        bias = state.get_buffer(f"{name}.expert_bias_E")
        counts_f = counts.float()
        delta = layer.load_balance_coeff * torch.sign(counts_f.mean() - counts_f)
        bias.add_(delta - delta.mean())
        counts.zero_()


ADAPTER = register(Adapter(
    name="torchtitan_moe", tracing=tracing_context,
    idle_parameters=idle_parameters, training_state_kept=counts_kept,
    after_step=update_expert_bias))
