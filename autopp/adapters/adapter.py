"""What a model adapter gives autopp: one value per model library (:class:`Adapter`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ContextManager

from torch import nn

from autopp import init, tracing


@contextlib.contextmanager
def _nothing(*args: Any) -> Iterator[None]:
    yield


@dataclass(frozen=True)
class Adapter:
    """How autopp treats the module classes of one model library. Every hook has a default
    that does nothing, so an adapter gives only what its modules need."""

    name: str
    """Its name (e.g. "torchtitan_moe"); registering a name again replaces the adapter."""
    tracing: Callable[[], ContextManager] = _nothing
    """A context under which its modules run on meta and trace in the form autopp plans.
    Choices that change what it traces are tracing settings (:func:`autopp.tracing.declare`,
    read with :func:`autopp.tracing.setting`): plans record them, the cache key holds them."""
    idle_parameters: Callable[[nn.Module], float] = field(default=lambda model: 0.0)
    """Parameters of ``model`` a token does not use on average (MoE: the routed experts it
    is not routed to)."""
    training_state_kept: Callable[[list, nn.Module], ContextManager] = _nothing
    """A context restoring the statistics its modules accumulate in the forward."""
    after_step: Callable[[list, nn.Module, Any], None] = field(
        default=lambda structure, state, partial_over: None)
    """Its state updates once per step, before the optimizer (e.g. MoE load balancing)."""
    prepare: Callable[[nn.Module], list[str]] = field(default=lambda model: [])
    """Settings of a whole model it changes before the model is split (e.g. the attention
    implementation a transformers model dispatches to); returns one line per change, which
    autopp logs and the pipeline's ``describe()`` shows."""
    module_init: Callable[[nn.Module, nn.Module], Callable[[], None] | None] = field(
        default=lambda root, module: None)
    """For ``module`` inside ``root``, the model's own initialiser of ``module``'s own
    parameters and buffers (e.g. transformers' ``root._init_weights(module)``), or None
    (autopp then uses ``reset_parameters``)."""


_ADAPTERS: list[Adapter] = []


def register(adapter: Adapter) -> Adapter:
    """Add a model library's adapter: its tracing context is entered wherever autopp runs or
    traces a model on meta (:mod:`autopp.tracing`), and its hooks join the functions of
    :mod:`autopp.adapters`. Registering the same name again replaces the earlier adapter."""
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.name != adapter.name] + [adapter]
    tracing.register(adapter.tracing)
    init.register_module_init(adapter.module_init)
    return adapter


def registered() -> tuple[Adapter, ...]:
    """The adapters in registration order."""
    return tuple(_ADAPTERS)
