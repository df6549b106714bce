r"""A stage's once-per-step collectives, and how much of them its schedule hides.

A planned stage gathers its dp-sharded weights once per step (UNSHARD: the ILP's edges out
of parameter-only values, :func:`autopp.graph.walk.param_only_nodes`) and reduces its
gradients once per step (REDUCE_GRAD: the gradient-to-parameter ties). With collectives
issued ahead (autopp's graph runtime with ``overlap_collectives`` on, its default;
``StageGraphs.collectives_ahead``) both run on the rank's communication stream beside
compute: a stage's gathers from the step's start until its first action, its reductions
from its last backward until the step's end. How long those windows are is the schedule's
business (:func:`autopp.schedules.comm_windows.collective_windows`: a 1F1B rank r waits
r forwards for its first input; the first stage waits for nothing). The step pays only
what exceeds them.

So the stage's time per microbatch, with :math:`t(x)` everything but these collectives,
:math:`C_k(x)` kind k's collectives (1/M of their time a step, M microbatches) and
:math:`W_k` its window (per microbatch too), is

.. math::

    T(x) = t(x) + \sum_k \max(0,\; C_k(x) - W_k).

It is not linear, and the planner's units are solved apart, so the ILP keeps pricing the
collectives in full (:math:`t + \sum_k C_k`, the upper bound it always priced) and this
module decides whether that choice can be improved, and by how much at most:

* the full-price chain :math:`x_1` (what :func:`~autopp.sharding.budget.choose_chain`
  returns) has :math:`T(x_1) = t(x_1) + \sum_k C_k(x_1) - \sum_k \min(C_k(x_1), W_k)`;
* every plan that fits has :math:`T(x) \ge \min_y (t + \sum_k C_k)(y) - \sum_k \min(C_k(x),
  W_k) \ge B_1 - \sum_k \min(\bar C_k, W_k)`, with :math:`B_1` the full-price search's
  certified bound and :math:`\bar C_k` the most kind k's collectives can cost in any plan
  (:attr:`Model.once_max_s <autopp.sharding.solver.Model.once_max_s>`: each edge at its
  dearest pair);
* where :math:`T(x_1)` is within :data:`~autopp.sharding.budget.CERTIFIED_GAP` of that
  bound, :math:`x_1` stands (a 70B stage's weights move once a step for a hundred
  microbatches of compute: the collectives cannot buy 1%); else the stage is planned again
  with the collectives all but free (``Model(once_weight=FREE_WEIGHT)``: :math:`\min t +
  w \sum_k C_k`, whose bound less :math:`w \sum_k \bar C_k` also bounds :math:`T`), and
  the faster of the two by :math:`T` is kept.

With no window (the first stage of 1F1B, collectives that block) :math:`T` is the full
price and nothing changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

FREE_WEIGHT = 1e-3
r"""The collectives' weight in the second look's objective: all but free, so that among plans
of equal time it still takes the one that moves the fewest bytes (a weight of 0 left the
choice between them to the solver; a window the estimate overstates then costs the least).
Its bound on :math:`T` is :math:`B_0 - w \sum_k \bar C_k`."""

UNSHARD, REDUCE_GRAD = 0, 1
"""The two kinds, indices into the (UNSHARD, REDUCE_GRAD) pairs of this module."""


def once_kind(dst, i: int | None, src, param_nodes, param_only) -> int | None:
    """The kind of an ILP edge that runs once per step, or None for a per-microbatch edge:
    REDUCE_GRAD for a gradient flowing into its parameter (a tie, ``i`` None), UNSHARD for
    an edge out of a parameter-only value (a cast, view or gather of weights)."""
    if i is None and dst in param_nodes:
        return REDUCE_GRAD
    if src in param_only:
        return UNSHARD
    return None


def chain_once(results: Sequence) -> tuple[float, float]:
    """(UNSHARD, REDUCE_GRAD) seconds per microbatch of a chain's unit solutions, at their
    full price (:attr:`SolveResult.once_comm_s`)."""
    return (sum(r.once_comm_s[UNSHARD] for r in results),
            sum(r.once_comm_s[REDUCE_GRAD] for r in results))


def hidden_s(once: Sequence[float], windows: Sequence[float]) -> float:
    """What the windows hide of ``once`` (both per microbatch, by kind)."""
    return sum(min(c, w) for c, w in zip(once, windows))


def exposed_time_s(full_time_s: float, once: Sequence[float], windows: Sequence[float]
                   ) -> float:
    """:math:`T`: a chain's time at full price less what its windows hide."""
    return full_time_s - hidden_s(once, windows)


def bound_with_windows(full_bound_s: float, once_max: Sequence[float],
                       windows: Sequence[float]) -> float:
    r"""A lower bound on :math:`T` of every plan that fits, from a lower bound on the full
    price (:math:`B_1 - \sum_k \min(\bar C_k, W_k)`)."""
    return full_bound_s - hidden_s(once_max, windows)


def at_full_price(res, weight: float):
    """A unit solution of a model whose objective weighed the once-per-step collectives by
    ``weight`` (:attr:`Model.once_weight`), with them priced in full again: what the plan
    records (its time, the simulator's input, stays the collectives' whole time; the
    simulator hides what the schedule hides)."""
    extra = (1.0 - weight) * sum(res.once_comm_s)
    if not extra:
        return res
    return dataclasses.replace(res, objective_s=res.objective_s + extra,
                               comm_s=res.comm_s + extra)
