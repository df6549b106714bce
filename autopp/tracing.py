"""Contexts autopp enters whenever it runs a model on meta or traces it for planning.

Some layers cannot run on meta or trace as they are written (a MoE router's autocast). The
code that knows them (the model adapters, :mod:`autopp.adapters`) registers a context here,
and the floors below it (the stage split's checks, the planner's trace) enter them through
this module without importing their owners. ``import autopp`` imports the adapters first
(they are light), so the registrations are in place before any model is split or traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager

_ON_META: list[Callable[[], ContextManager]] = []


def register(factory: Callable[[], ContextManager]) -> None:
    """Enter ``factory()`` whenever a model runs on meta or is traced. Registering twice is a
    no-op."""
    if factory not in _ON_META:
        _ON_META.append(factory)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """The registered contexts, entered in registration order."""
    with contextlib.ExitStack() as stack:
        for factory in _ON_META:
            stack.enter_context(factory())
        yield
