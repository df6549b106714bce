"""Model adapters: the only place autopp knows a model library's module classes.

The planner and runtime are model-agnostic (aten graphs, parameters by FQN, repeated blocks);
an adapter says how to trace a module class it recognises and what state it carries:

* :mod:`~autopp.adapters.transformers_hf`: a ``PreTrainedModel`` as it is (autopp's
  attention, no KV cache, the model's own ``_init_weights`` per module);
* :mod:`~autopp.adapters.torchtitan_moe` / :mod:`~autopp.adapters.transformers_moe`:
  routed experts as ``autopp::routed_experts`` (:mod:`autopp.ops.experts`).

Adapters are a registry (:func:`register`, :class:`~autopp.adapters.adapter.Adapter`): a new
library's adapter is one module that registers an ``Adapter``, plus its import line here. Each
adapter's tracing context is registered with :mod:`autopp.tracing`, which autopp enters
wherever it runs or traces a model on meta.
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
