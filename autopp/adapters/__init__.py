"""Model adapters: the only place autopp knows a model library's module classes.

The planner and the runtime are model-agnostic: they see aten graphs, parameters by FQN and
blocks that repeat. A few layers cannot be traced as they are written; an adapter says, for a
module class it recognises, how to trace it (and what state it carries between steps).

* :mod:`autopp.adapters.torchtitan_moe`: torchtitan's mixture-of-experts layers
  (``MoE``, ``RoutedExperts``, ``TokenChoiceTopKRouter``): routed experts traced as the op
  ``autopp::routed_experts`` (:mod:`autopp.sharding.experts`), the router's autocast on meta,
  and the load-balancing expert-bias update after each step.

:func:`tracing` is entered wherever autopp runs or traces a model on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """While active, adapted modules trace in the form the planner plans (see above)."""
    from autopp.adapters import torchtitan_moe

    with torchtitan_moe.tracing():
        yield


@contextlib.contextmanager
def training_state_kept(modules: list[nn.Module]) -> Iterator[None]:
    """Training statistics adapted modules accumulate in their forward (e.g. MoE token
    counts) are restored on exit: an evaluation pass does not count."""
    from autopp.adapters import torchtitan_moe

    with torchtitan_moe.counts_kept(modules):
        yield


def after_step(modules: list[nn.Module]) -> None:
    """State updates adapted modules make once per optimizer step (before it), e.g. MoE
    load balancing. ``modules`` are a rank's stage modules; called on every rank."""
    from autopp.adapters import torchtitan_moe

    torchtitan_moe.update_expert_bias(modules)
