"""The largest tensor a redistribution makes on its way (DTensor's own path, the landed
value included), per device: what ``MemorySpec.largest_tensor_bytes`` bounds for the ILP's
edge columns (:meth:`autopp.sharding.ilp.solver.Model.column_bytes`)."""

from __future__ import annotations

import logging
from typing import Any

from autopp._compat.sharding import redistribution_peak_bytes

logger = logging.getLogger(__name__)

_PEAKS: dict[tuple, dict[tuple, float]] = {}
"""By (mesh shape, this rank's coordinate) and then (shape, dtype, src, dst): a peak depends
on nothing else, so every Model of the process shares it (a search builds one per probe
unit, and the same activations recur across them)."""

_PEAKS_MAX = 1 << 21
"""Entries one table keeps before it starts again (bounds a long process's memory)."""


def peak_table(mesh) -> dict[tuple, float]:
    """The table of ``mesh`` (None: no mesh)."""
    return _PEAKS.setdefault(
        (None,) if mesh is None else (tuple(mesh.shape), tuple(mesh.get_coordinate() or ())),
        {})


def redistribution_bytes(table: dict[tuple, float], mesh, costs, val: Any, a: Any, g: Any
                         ) -> float:
    """The largest local tensor moving ``val`` from placement ``a`` to ``g`` makes on
    ``mesh`` (``costs``: the :class:`~autopp.sharding.cost.model.CostModel` that sizes the ends);
    remembered in ``table`` (:func:`peak_table`)."""
    if a == g:
        return costs.local_bytes(val, g)
    key = (tuple(val.shape), val.dtype, a, g)
    hit = table.get(key)
    if hit is None:
        try:
            hit = float(redistribution_peak_bytes(mesh, val, a, g)) if mesh is not None \
                else None
        except Exception as e:  # a pair DTensor's planner refuses: bound by both ends
            logger.warning("largest-tensor bound: DTensor plans no path %s -> %s for "
                           "shape %s (%s); its ends' sizes stand in", a, g,
                           tuple(val.shape), e)
            hit = None
        if hit is None:
            hit = max(costs.local_bytes(val, a), costs.local_bytes(val, g))
        if len(table) >= _PEAKS_MAX:
            table.clear()
        table[key] = hit
    return hit
