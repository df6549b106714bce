"""Ops whose kernel communicates: how the planner offers, prices and runs them.

DTensor's sharding rules describe ops whose local kernel needs no communication; the
collectives are the redistributions between ops, which :mod:`costs` prices and DTensor
performs. A few ops cannot be written that way: routed experts that send each token only to
the devices holding its experts (:mod:`autopp.sharding.expert_dispatch`) exchange a
data-dependent number of rows inside the kernel. Such an op registers three hooks here,
keyed by its ``OpOverload``:

* ``extra_options(node, options, mesh_shape)``: options to add to (or, by returning a
  filtered list, to replace) those DTensor's rule gave (:mod:`strategies`);
* ``collectives(node, option, mesh_shape)``: the collectives the kernel runs for an option,
  as ``(kind, mesh_dim, local_bytes)`` (:mod:`costs` prices them like a redistribution's);
* ``local_call(node, option, mesh)``: ``None`` when DTensor can run the option as usual, or
  a function of the local shards (the interpreter wraps its result in the planned output
  placements; :mod:`interpret`);
* ``pinned``: positions of tensor arguments that are the op's own state (e.g. the routing
  a forward op returns for its backward op): their values are per device, so they must
  arrive exactly as produced; the solver links only equal placements on those edges
  (:mod:`solver`), never a redistribution.
"""

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


_HOOKS: dict[Any, OpHooks] = {}


def register(op: Any, hooks: OpHooks) -> None:
    """Register ``hooks`` for ``op`` (an ``OpOverload``)."""
    _HOOKS[op] = hooks


def hooks_of(op: Any) -> OpHooks | None:
    """The hooks registered for ``op``, if any."""
    return _HOOKS.get(op)
