"""Model adapters: the only place autopp knows a model library's module classes.

The planner and the runtime are model-agnostic: they see aten graphs, parameters by FQN and
blocks that repeat. A few layers cannot be traced as they are written; an adapter says, for a
module class it recognises, how to trace it (and what state it carries between steps).

* :mod:`autopp.adapters.transformers_hf`: Hugging Face transformers' ``PreTrainedModel``:
  attention through autopp's fused op (``attn_implementation="autopp"``), no KV cache, and
  the model's own ``_init_weights`` per module (buffers such as ``inv_freq`` included).
* :mod:`autopp.adapters.torchtitan_moe`: torchtitan's mixture-of-experts layers
  (``MoE``, ``RoutedExperts``, ``TokenChoiceTopKRouter``): routed experts traced as the op
  ``autopp::routed_experts`` (:mod:`autopp.ops.experts`), the router's autocast on meta,
  and the load-balancing expert-bias update after each step.
* :mod:`autopp.adapters.transformers_moe`: transformers' experts modules
  (``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, ...): routed experts run
  and trace as ``autopp::routed_experts`` (``experts_implementation="autopp"``) where a check
  on a small CPU copy finds it computes the module's own function; the router's auxiliary
  loss (``output_router_logits=True``), which a pipeline's loss cannot add, refused by name.

Adapters are a registry (:func:`register`, :class:`~autopp.adapters.adapter.Adapter`): a
new model library's adapter is one module that builds an ``Adapter`` and registers it, plus
its import line in this file. Each adapter's tracing context is registered with
:mod:`autopp.tracing`, which autopp enters wherever it runs or traces a model on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn

from autopp.adapters import (  # noqa: F401  (register themselves)
    torchtitan_moe, transformers_hf, transformers_moe)
from autopp.adapters.adapter import Adapter, register, registered  # noqa: F401  (public)


def settings() -> dict[str, str]:
    """The adapters' settings that change what is traced, as they apply here (part of the
    plan cache's key): :func:`autopp.tracing.current_settings`."""
    from autopp import tracing

    return tracing.current_settings()


def active_parameters(model: nn.Module) -> float:
    """Parameters a token uses on average (for model FLOPs, 6 x this x tokens): all of a
    dense model's; a MoE layer's routed experts count top_k / num_experts of theirs."""
    return sum(p.numel() for p in model.parameters()) - sum(
        a.idle_parameters(model) for a in registered())


@contextlib.contextmanager
def training_state_kept(structure: list[nn.Module], state: nn.Module) -> Iterator[None]:
    """Training statistics adapted modules accumulate in their forward (e.g. MoE token
    counts) are restored on exit: an evaluation pass does not count. ``structure``: a
    rank's stage modules as built (names, the model's config); ``state``: the module whose
    buffers, by the same FQNs, the stages run with."""
    with contextlib.ExitStack() as stack:
        for a in registered():
            stack.enter_context(a.training_state_kept(structure, state))
        yield


def prepare(model: nn.Module) -> list[str]:
    """Let each adapter set what its models need before ``model`` is split (logged; the
    returned lines are shown by the pipeline's ``describe()``)."""
    import logging

    notes = [line for a in registered() for line in a.prepare(model)]
    for line in notes:
        logging.getLogger("autopp").info("%s", line)
    return notes


def after_step(structure: list[nn.Module], state: nn.Module,
               partial_over: dist.ProcessGroup | None = None) -> None:
    """State updates adapted modules make once per step, before the optimizer (e.g. MoE
    load balancing); called on every rank. ``structure`` and ``state`` as for
    :func:`training_state_kept`; ``partial_over``: the group over which the statistics the
    forward kept are partial sums (None: they are whole already)."""
    for a in registered():
        a.after_step(structure, state, partial_over)
