"""Time-only solves shared across a unit model's memory accountings.

A solve with neither a memory price nor a budget (:meth:`autopp.sharding.ilp.solver.Model.solve`
at price 0, no budget) never reads the memory row: its LP, hence its solution, is the same
under every accounting of the model's columns that shares the row's structure (another
activation factor: a stage with another number of microbatches in flight; the structure,
``Terms``' columns and rows, is in the key through the LP's sizes). Such a solve is run once
and its result re-counted under each accounting (:func:`lookup`); the table lives on the
model and is shared by its ``with_memory`` copies. The key (made by the solver) holds
everything the LP is made of besides the row: the recomputation policy and state accounting,
the column bounds (boundary pair, fixed parameters, largest-tensor bound), the time limit,
threads, gap, node limit and rounding; the model itself stands for its columns and costs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from autopp.sharding.ilp.memory_row import Terms
    from autopp.sharding.ilp.solution import SolveResult
    from autopp.sharding.ilp.solver import Model

LIMIT = 256
"""Time-only solutions a model keeps (per boundary pair and recomputation policy: a few)."""


def lookup(model: Model, key: tuple, t: Terms, recompute: Any, n_cols: int
           ) -> SolveResult | None:
    """The shared solution under ``key``, its memory counted under ``model``'s row
    (``t``: its terms for ``recompute``); None where there is none yet."""
    hit = model._time_only.get(key)
    if hit is None:
        return None
    res, cols, vals = hit
    acc = model.account(res.choice, recompute)
    ilp_mem = res.ilp_memory_bytes
    if ilp_mem == ilp_mem:  # not a rounded LP's (nan): the row at the solver's point
        x = np.zeros(n_cols)
        x[cols] = vals
        ilp_mem = model.memory_row.row_bytes(t, x)
    return replace(res, solve_s=0.0, state_bytes=acc.state_bytes,
                   activation_bytes=acc.activation_bytes, gathered_bytes=acc.gathered_bytes,
                   kept_for_w_bytes=acc.kept_for_w_bytes, memory_bytes=acc.counted_bytes,
                   ilp_memory_bytes=ilp_mem)


def store(model: Model, key: tuple, res: SolveResult, x: np.ndarray) -> None:
    """Keep ``res`` (solved from the column values ``x``) under ``key``."""
    table = model._time_only
    if len(table) >= LIMIT:
        table.pop(next(iter(table)))
    cols = np.flatnonzero(x)
    table[key] = (res, cols, x[cols])
