"""Hugging Face transformers' mixture-of-experts layers (Mixtral, Qwen2/3-MoE, OLMoE, ...).

Experts modules decorated with ``@use_experts_implementation`` (weights ``gate_up_proj``
``(E, 2F, D)``, ``down_proj`` ``(E, D, F)``) call what the config's
``_experts_implementation`` names in transformers' ``ExpertsInterface``; autopp registers
``"autopp"`` there, so the experts run and trace as ``autopp::routed_experts``, which has a
sharding rule over any mesh dims and a meta form (transformers' ``grouped_mm`` meets a
bf16-only meta kernel, its ``eager`` loop a ``nonzero``). Router, top-k and shared experts
stay the model's own code. Invariants: switched only after :func:`verify` finds the op equal
to the module's own on a small CPU copy (else it keeps its own, named in ``describe()``);
experts compute in their weights' dtype (bf16 rounds each routed row before the sum, as
torchtitan's combine: as accurate, not bit-equal); the router's auxiliary loss
(``output_router_logits=True``) never reaches a pipeline's loss on the last stage, so such a
config is refused by name (:func:`_refuse_router_loss`), never dropped silently.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from autopp import tracing
from autopp.adapters.adapter import Adapter, register

IMPLEMENTATION = "autopp"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What :func:`verify` found for one experts configuration."""

    equal: bool
    """Whether ``autopp::routed_experts`` computes the module's own function."""
    against: str
    """The implementation it was compared with (the module's own; its ``"eager"``
    definition where the module's own does not run on CPU)."""
    reason: str = ""
    """Why not, when not equal."""


_VERDICTS: dict[tuple, Verdict] = {}
"""Per experts configuration (:func:`_key`), the check's verdict."""


def _pretrained(model: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (``@use_experts_implementation``:
    its layout flags and a config naming the implementation)."""
    return (all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed",
                                             "is_concatenated", "_is_expert_parallel"))
            and hasattr(getattr(module, "config", None), "_experts_implementation"))


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every transformers experts module of ``model``."""
    return [(name, m) for name, m in model.named_modules() if is_experts(m)]


def own_implementation(module: nn.Module) -> str:
    """The experts implementation ``module`` had before autopp's (its config's, else the one
    ``prepare`` recorded)."""
    name = module.config._experts_implementation
    if name != IMPLEMENTATION:
        return name or "eager"
    return getattr(module, "_autopp_own_experts", "eager")  # set by hand: its definition


def own_forward(module: nn.Module, name: str | None = None) -> Callable[..., torch.Tensor]:
    """The model's own experts function for ``module`` (implementation ``name``, default its
    own): the implementation's in transformers' ``ExpertsInterface``, or its class's own
    forward (``"eager"``: transformers' definition of the module)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = own_implementation(module) if name is None else name
    eager = inspect.unwrap(type(module).forward)
    return eager if name == "eager" else ALL_EXPERTS_FUNCTIONS.get_interface(name, eager)


def layout_mismatch(module: nn.Module) -> str | None:
    """Why ``autopp::routed_experts`` cannot take ``module``'s weights as they are, or None."""
    flags = [("has_bias", True, "expert biases"), ("is_transposed", True, "transposed weights"),
             ("is_concatenated", False, "interleaved gate/up weights"),
             ("has_gate", False, "no gate (up projection only)"),
             ("has_post_expert_norm", True, "a norm after each expert"),
             ("_is_expert_parallel", True, "transformers' own expert parallelism")]
    for attr, bad, what in flags:
        if bool(getattr(module, attr, not bad)) == bad:
            return what
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]):
        return "weights not gate_up_proj (E, 2F, D) and down_proj (E, D, F)"
    return None


def routed(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
           top_k_weights: torch.Tensor) -> torch.Tensor:
    """``module``'s experts as ``autopp::routed_experts``: ``gate_up_proj``'s halves are the
    op's ``w1`` (gate) and ``w3`` (up), ``down_proj`` its ``w2``; tokens ``(T, D)`` as one
    sequence ``(1, T, D)`` (split over dp/tp by the op's sequence rule); the matmuls in the
    weights' dtype, as the model's own code (``PlannerOptions.expert_compute_dtype`` is for
    torchtitan's bf16 ``GroupedExperts`` and does not apply)."""
    import autopp.ops.experts  # noqa: F401  (registers the op)

    gate_up, down = module.gate_up_proj, module.down_proj
    n, f = gate_up.shape[0], down.shape[-1]
    d = hidden_states.shape[-1]
    x = hidden_states.reshape(1, -1, d).to(gate_up.dtype)
    k = top_k_index.shape[-1]
    out = torch.ops.autopp.routed_experts(
        x, top_k_weights.reshape(1, -1, k), top_k_index.reshape(1, -1, k),
        torch.arange(n, device=x.device), gate_up[:, :f], down, gate_up[:, f:], n, "",
        tracing.setting("token_dispatch"))[0]  # [1:]: the routing its backward reuses
    return out.reshape(hidden_states.shape).to(hidden_states.dtype)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The function autopp registers as ``"autopp"`` in transformers' ``ExpertsInterface``:
    the op where :func:`verify` found it computes the module's own function, else the
    module's own implementation."""
    verdict = _VERDICTS.get(_key(module))
    if verdict is None:
        raise ValueError(
            f"{type(module).__name__}: experts_implementation={IMPLEMENTATION!r} on a "
            "configuration autopp has not checked; call autopp.adapters.prepare(model) on the "
            "model before running it (pipeline_autoparallel does)")
    if verdict.equal:
        return routed(module, hidden_states, top_k_index, top_k_weights)
    try:
        return own_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    except Exception as e:  # e.g. traced on meta or fake tensors by the planner
        raise RuntimeError(
            f"{type(module).__name__} runs its own {own_implementation(module)!r} experts "
            f"(not autopp::routed_experts: {verdict.reason}), which failed here "
            f"({type(e).__name__}: {e}); the planner cannot trace them, parallelize=None or "
            "your own parallelize function runs them as written") from e


def _key(module: nn.Module) -> tuple:
    act = getattr(module, "act_fn", None)
    return (type(module).__qualname__, type(module).__module__, type(act).__qualname__,
            repr(act), own_implementation(module), layout_mismatch(module))


TOLERANCE = 1e-5
"""fp32 bound of :func:`verify`: each tensor's ``‖op − own‖ / ‖own‖`` (summation order
differs when a token has more than two experts)."""


def verify(module: nn.Module, tokens: int = 24, d: int = 16, f: int = 8,
           seed: int = 0) -> Verdict:
    """Whether ``autopp::routed_experts`` computes ``module``'s own experts function. Run on
    a copy of ``module`` with small random CPU fp32 weights (``d`` hidden, ``f`` per expert,
    its own expert count) on ``tokens`` tokens routed to distinct experts with random
    weights: the output and the gradients of the tokens, the routing weights and both
    weights, each within :data:`TOLERANCE`, against the module's own implementation, or
    its ``"eager"`` definition where that does not run on CPU (a CUDA kernel)."""
    own = own_implementation(module)
    reason = layout_mismatch(module)
    if reason is not None:
        return Verdict(equal=False, against=own, reason=reason)
    n = module.gate_up_proj.shape[0]
    k = min(int(getattr(module.config, "num_experts_per_tok", 2) or 2), n)
    gen = torch.Generator().manual_seed(seed)
    twin = copy.copy(module)  # its attributes and submodules (act_fn), weights of its own
    twin._parameters = dict(module._parameters)
    twin._autopp_own_experts = own
    twin.gate_up_proj = nn.Parameter(torch.randn(n, 2 * f, d, generator=gen) * 0.5)
    twin.down_proj = nn.Parameter(torch.randn(n, d, f, generator=gen) * 0.5)
    x = torch.randn(tokens, d, generator=gen, requires_grad=True)
    ids = torch.rand(tokens, n, generator=gen).topk(k, dim=-1).indices
    scores = torch.rand(tokens, k, generator=gen).requires_grad_(True)
    grad = torch.randn(tokens, d, generator=gen)
    leaves = [x, scores, twin.gate_up_proj, twin.down_proj]

    def run(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        with torch.enable_grad():
            out = fn(twin, x, ids, scores)
            return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    failed = ""
    for against in dict.fromkeys([own, "eager"]):
        try:
            theirs = run(own_forward(twin, against))
            break
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA-only kernel: try its definition
            failed = f"{failed}; " * bool(failed) + f"{against!r}: {type(e).__name__}: {e}"
    else:
        return Verdict(equal=False, against=own,
                       reason=f"the check could not run its own experts ({failed})")
    try:
        ours = run(routed)
    except Exception as e:  # noqa: BLE001 - a verdict, named
        return Verdict(equal=False, against=against,
                       reason=f"the op failed on a small copy ({type(e).__name__}: {e})")
    names = ["output", "tokens' gradient", "routing weights' gradient",
             "gate_up_proj's gradient", "down_proj's gradient"]
    for what, a, b in zip(names, theirs, ours):
        err = float((b - a).norm() / a.norm().clamp_min(1e-12))
        if not err <= TOLERANCE:
            return Verdict(equal=False, against=against, reason=(
                f"autopp::routed_experts differs from its {against!r} experts in the {what} "
                f"by {err:.2g} (relative, CPU fp32)"))
    return Verdict(equal=True, against=against)


def _refuse_router_loss(model: nn.Module) -> None:
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for c in configs.values():
        if getattr(c, "output_router_logits", False):
            raise ValueError(
                f"transformers {type(model).__name__}: output_router_logits=True adds the "
                f"router's auxiliary loss (router_aux_loss_coef="
                f"{getattr(c, 'router_aux_loss_coef', None)}) to the loss computed from "
                "every layer's router logits; a pipeline computes loss_fn on the last stage's "
                "logits, where the other stages' router logits are not, so autopp cannot add "
                "it. Set config.output_router_logits=False (training without the auxiliary "
                "loss, as transformers does without it) or train this model unpipelined")


def _prepare(model: nn.Module) -> list[str]:
    if not _pretrained(model):
        return []
    modules = experts_modules(model)
    if not modules:
        return []
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import autopp._compat.sharding  # noqa: F401  (DTensor's topk cache keyed by k: routers)

    _refuse_router_loss(model)
    if ALL_EXPERTS_FUNCTIONS._global_mapping.get(IMPLEMENTATION) is not experts_forward:
        type(ALL_EXPERTS_FUNCTIONS).register(IMPLEMENTATION, experts_forward)
    name = type(model).__name__
    notes, seen = [], {}
    for fqn, m in modules:
        m._autopp_own_experts = own_implementation(m)
        key = _key(m)
        if key not in _VERDICTS:
            _VERDICTS[key] = verify(m)
        seen.setdefault(key, (fqn, m))
    for key, (fqn, m) in seen.items():
        verdict = _VERDICTS[key]
        where = f"{type(m).__name__} (e.g. {fqn})"
        if verdict.equal:
            notes.append(
                f"transformers {name}: experts {where} {key[4]!r} -> autopp::routed_experts "
                f"(checked equal to its {verdict.against!r} experts on CPU fp32, forward and "
                "backward; in bf16 each routed row is rounded before the sum)")
        else:
            notes.append(f"transformers {name}: experts {where} run as written ({key[4]!r}): "
                         f"{verdict.reason}; the planner cannot trace them")
    if any(m.config._experts_implementation != IMPLEMENTATION for _, m in modules):
        model.set_experts_implementation(IMPLEMENTATION)
    return notes


def idle_parameters(model: nn.Module) -> float:
    """Routed-expert parameters a token does not use, on average: each experts module's
    weights times (1 - top_k / num_experts)."""
    idle = 0.0
    for _, m in experts_modules(model):
        n = m.gate_up_proj.shape[0] if hasattr(m, "gate_up_proj") else None
        k = getattr(m.config, "num_experts_per_tok", None)
        if n and k:
            idle += sum(p.numel() for p in m.parameters()) * (1 - k / n)
    return idle


ADAPTER = register(Adapter(name="transformers_moe", prepare=_prepare,
                           idle_parameters=idle_parameters))
