"""Split by cost: stage boundaries that balance the per-layer costs (Alpa's stage DP).

Every stage holds at least one layer; the pre modules (embedding) go with the first layer
and the post modules (norm, head) with the last, each at its own cost, so a heavy head makes
the last stage hold fewer layers (uneven layer counts where that balances time).

:func:`balanced_cuts` is the dynamic programme over a sequence of unit costs: it minimises
the slowest stage (the pipeline's steady-state period) and, among splits with the same
slowest stage, the sum of squared stage times (so the other stages are balanced too), subject
to a per-stage feasibility test (memory). It runs in O(stages × units²), vectorised over the
cut positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from autopp.stage_split.layout import ModelLayout

__all__ = ["balanced_cuts", "split_balanced", "stage_fqns"]

Fits = Callable[[int, int, int], bool]
"""``fits(stage, first, end)``: whether units ``first .. end-1`` fit as stage ``stage``."""


def balanced_cuts(costs: Sequence[float], n_stages: int, *, fits: Fits | None = None,
                  stage_table: Sequence[Sequence[float]] | None = None,
                  empty_ends: bool = False) -> list[int] | None:
    """Cut ``len(costs)`` units into ``n_stages`` contiguous stages.

    Args:
        costs: each unit's cost (seconds per microbatch), in order.
        n_stages: number of stages.
        fits: per-stage feasibility (e.g. memory); None: every stage fits.
        stage_table: ``stage_table[stage][k]``, the cost of ``stage`` holding ``k`` alike units
            where that is not a sum (``inf``: does not fit), or ``stage_table[stage][i][j]``,
            of units ``i .. j-1`` where they differ; ``costs`` then gives only the count.
        empty_ends: the first and last stage may hold no unit (only the pre or post modules).

    Returns the ``n_stages + 1`` cut indices of the split that minimises the slowest stage, then
    the sum of squared stage costs (the first cut wins a tie); None when no split fits."""
    n = len(costs)
    lo = [0 if empty_ends and s in (0, n_stages - 1) else 1 for s in range(n_stages)]
    if n_stages < 1 or sum(lo) > n:
        raise ValueError(f"cannot cut {n} units into {n_stages} stages"
                         + (" (the first and last may be empty)" if empty_ends else
                            " non-empty stages"))
    upto = np.cumsum(lo)  # units the stages 0..s hold at least
    after = sum(lo) - upto  # ... and the stages after s
    # cost[s, i, j]: units i .. j-1 as stage s (inf where it holds too few or does not fit)
    i_idx, j_idx = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    span = j_idx - i_idx
    enough = np.stack([span >= lo[s] for s in range(n_stages)])
    if stage_table is not None:
        table = np.asarray(stage_table, dtype=np.float64)
        if table.shape == (n_stages, n + 1, n + 1):  # by first and end unit
            cost = np.where(enough, table, np.inf)
        elif table.shape == (n_stages, n + 1):  # by the count of alike units
            cost = np.where(enough, table[:, np.clip(span, 0, n)], np.inf)
        else:
            raise ValueError(f"stage_table must be {n_stages} x {n + 1} (x {n + 1}), got "
                             f"{table.shape}")
    else:
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
        cost = np.where(enough, (prefix[None, :] - prefix[:, None])[None], np.inf)
        if fits is not None:
            for s in range(n_stages):
                for i in range(n + 1):
                    for j in range(i + lo[s], n + 1):
                        if not fits(s, i, j):
                            cost[s, i, j] = np.inf
    # best[j]: (slowest, sum of squares) of units 0..j-1 in s+1 stages; arg: the last cut
    ends = np.arange(n + 1)
    ok = (ends >= upto[0]) & (ends <= n - after[0])
    slow = np.where(ok, cost[0, 0], np.inf)
    squares = np.where(np.isfinite(slow), slow * slow, np.inf)
    args = np.full((n_stages, n + 1), -1)
    for s in range(1, n_stages):
        c = cost[s]
        valid = ((i_idx >= upto[s - 1]) & (j_idx - i_idx >= lo[s]) & (j_idx >= upto[s])
                 & (j_idx <= n - after[s]))
        cand = np.where(valid, np.maximum(slow[:, None], c), np.inf)
        low = cand.min(axis=0)
        tie = (cand == low[None, :]) & np.isfinite(low)[None, :]
        sq = np.where(tie, squares[:, None] + c * c, np.inf)
        arg = sq.argmin(axis=0)
        found = np.isfinite(low)
        args[s] = np.where(found, arg, -1)
        slow = low
        squares = np.where(found, sq[arg, np.arange(n + 1)], np.inf)
    if not np.isfinite(slow[n]):
        return None
    cuts = [n]
    j = n
    for s in range(n_stages - 1, 0, -1):
        j = int(args[s][j])
        cuts.append(j)
    cuts.append(0)
    return cuts[::-1]


def split_balanced(layout: ModelLayout, n_stages: int, *, layer_costs: Sequence[float],
                   pre_cost: float = 0.0, post_cost: float = 0.0,
                   fits: Fits | None = None) -> list[list[str]] | None:
    """FQNs per stage of the cost-balanced split of a model.

    Args:
        layout: the model's layout (:func:`autopp.stage_split.inspect_model`).
        n_stages: number of stages (all virtual stages, for looped schedules).
        layer_costs: each layer's cost, in order (seconds per microbatch).
        pre_cost / post_cost: the cost of the pre modules (embedding) and of the post
            modules (final norm, head): added to the first and the last layer's.
        fits: per-stage feasibility over layer indices (see :func:`balanced_cuts`).

    Returns:
        For each stage, the module FQNs it holds, in model order; None when nothing fits.
    """
    if len(layer_costs) != layout.n_layers:
        raise ValueError(f"{len(layer_costs)} layer costs for {layout.n_layers} layers")
    if n_stages > layout.n_layers:
        raise ValueError(f"cannot split {layout.n_layers} layers into {n_stages} stages: "
                         "every stage holds at least one layer; use fewer stages")
    costs = [float(c) for c in layer_costs]
    costs[0] += pre_cost
    costs[-1] += post_cost
    cuts = balanced_cuts(costs, n_stages, fits=fits)
    return None if cuts is None else stage_fqns(layout, cuts)


def stage_fqns(layout: ModelLayout, cuts: Sequence[int]) -> list[list[str]]:
    """FQNs per stage of the split at ``cuts`` (layer indices, 0 first, the layer count
    last): the pre modules with the first stage, the post modules with the last."""
    layers = layout.layer_fqns
    stages = [list(layers[a:b]) for a, b in zip(cuts, cuts[1:])]
    stages[0] = [*layout.pre, *stages[0]]
    stages[-1] = [*stages[-1], *layout.post]
    return stages
