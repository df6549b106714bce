"""Contexts autopp enters whenever it runs a model on meta or traces it for planning.

Some layers cannot run on meta or trace as they are written (a MoE router's autocast, SDPA
that should stay one op in the planner's graph). The code that knows them (the model
adapters, :mod:`autopp.adapters`; the ops, :mod:`autopp.ops`) registers a context here, and
the floors below it (the stage split's checks, the planner's trace) enter them through this
module without importing their owners. ``import autopp`` imports the ops and the adapters
first, so the registrations are in place before any model is split or traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager

_ON_META: list[Callable[[], ContextManager]] = []
_JOINT: list[Callable[[], ContextManager]] = []


def register(factory: Callable[[], ContextManager], *, joint_only: bool = False) -> None:
    """Enter ``factory()`` whenever a model runs on meta or is traced (``joint_only``: only
    while the planner traces a joint forward+backward graph). Registering twice is a no-op."""
    bucket = _JOINT if joint_only else _ON_META
    if factory not in bucket:
        bucket.append(factory)


@contextlib.contextmanager
def on_meta(*, joint: bool = False) -> Iterator[None]:
    """The registered contexts (``joint``: also the joint-trace-only ones, entered outside
    the others), in registration order."""
    with contextlib.ExitStack() as stack:
        for factory in (*(_JOINT if joint else ()), *_ON_META):
            stack.enter_context(factory())
        yield
