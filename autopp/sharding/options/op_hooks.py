"""Ops whose kernel communicates: how the planner offers, prices and runs them.

DTensor's rules describe ops whose local kernel needs no communication; collectives are the
redistributions between ops. An op that exchanges data-dependent rows inside its kernel
(:mod:`autopp.sharding.options.expert_dispatch`) registers hooks here, keyed by its ``OpOverload``:
``extra_options`` (options added to, or replacing, the rule's: :mod:`strategies`),
``collectives`` (what the kernel runs for an option, ``(kind, mesh_dim, local_bytes)``, priced
by :mod:`costs`), ``local_call`` (a function of the local shards, or None for DTensor's usual
run: :mod:`interpret`), and ``pinned`` (arguments that are the op's own per-device state,
which the solver links only in equal placements, never through a redistribution)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class OpHooks:
    extra_options: Callable[[Any, list, tuple[int, ...]], list]
    """(node, DTensor's options, mesh shape) -> the node's options."""
    collectives: Callable[[Any, Any, tuple[int, ...]], list[tuple[str, int, float]]]
    """(node, option, mesh shape) -> [(collective kind, mesh dim, local bytes in)]."""
    local_call: Callable[[Any, Any, Any], Callable[..., Any] | None]
    """(node, option, mesh) -> a function of the local shards, or None."""
    pinned: tuple[int, ...] = ()
    """Tensor-argument positions taken only in the placement their producer gave them."""
    busiest_share: Callable[[Any, Any], float] | None = None
    """(node, option) -> the busiest device's compute over the even split's (data-dependent
    work, e.g. routed tokens); None: 1."""


_HOOKS: dict[Any, OpHooks] = {}


def register(op: Any, hooks: OpHooks) -> None:
    """Register ``hooks`` for ``op`` (an ``OpOverload``)."""
    _HOOKS[op] = hooks


def hooks_of(op: Any) -> OpHooks | None:
    """The hooks registered for ``op``, if any."""
    return _HOOKS.get(op)
