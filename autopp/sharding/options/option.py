"""One way to run a node of a joint graph (:class:`Option`: output placements and the
placement each input must arrive in), and the shape helpers every user of options needs.
:mod:`autopp.sharding.options.strategies` enumerates them; op hooks
(:mod:`autopp.sharding.options.op_hooks`) add their own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopp._compat import sharding as compat

Placements = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Option:
    """One way to run a node: output placements and the placement each input must have."""

    out: tuple[Placements, ...]
    """Placements of each tensor output (one entry for single-output nodes)."""
    ins: tuple[Placements, ...]
    """Required placements of each tensor argument, in :attr:`NodeStrategy.edges` order."""


def tensor_vals(node: fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]):
    """Per-device shape, or None if a sharded dim does not divide evenly."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape):
        kind = compat.placement_kind(p)
        if kind == "strided":
            return None
        if kind == "shard":
            if out[p.dim] % n:
                return None
            out[p.dim] //= n
    return out


PlacementSpec = Sequence[Any | None]
"""Placements asked for, one per mesh dim; None: any placement on that dim."""


def matches(pl: Sequence[Any], spec: PlacementSpec | None) -> bool:
    """Whether placements ``pl`` are what ``spec`` asks for (None, or None on a dim: any)."""
    return spec is None or all(s is None or p == s for p, s in zip(pl, spec))
