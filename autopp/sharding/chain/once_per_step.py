r"""A stage's once-per-step collectives, and how much of them its schedule hides.

A planned stage gathers dp-sharded weights (UNSHARD) and reduces gradients (REDUCE_GRAD) once
per step; issued ahead, they run beside compute in the windows the schedule leaves
(:mod:`autopp.schedules.comm_windows`). With :math:`t(x)` the rest of the stage's time and
:math:`C_k(x)` kind k's collectives against window :math:`W_k`, the stage takes
:math:`T(x) = t(x) + \sum_k \max(0, C_k(x) - W_k)`. That is not linear and units are solved
apart, so the ILP prices collectives in full, and this module decides whether the full-price
chain :math:`x_1` can be improved: it stands where :math:`T(x_1)` is within
:data:`~autopp.sharding.chain.budget.CERTIFIED_GAP` of :math:`B_1 - \sum_k \min(\bar C_k, W_k)`
(:math:`B_1` the certified bound, :math:`\bar C_k` the dearest any plan's can be,
``Model.once_max_s``); else, where the fastest plan fits, a second time-only look with the
collectives nearly free (``FREE_WEIGHT``) is kept if faster by :math:`T`. Under a binding
budget the second look would be a second price search, so the plan's notes give the most the
windows could save instead."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from autopp.sharding.ilp.solver import REDUCE_GRAD, UNSHARD

logger = logging.getLogger(__name__)

FREE_WEIGHT = 1e-3
r"""The collectives' weight in the second look's objective: all but free, so that among plans
of equal time it still takes the one that moves the fewest bytes (a weight of 0 left the
choice between them to the solver; a window the estimate overstates then costs the least).
Its bound on :math:`T` is :math:`B_0 - w \sum_k \bar C_k`."""


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


_TIE = 1e-9
"""Relative margin by which the second look's chain must be faster to replace the first (a
tie, in floating point, keeps the chain that moves fewer bytes)."""


def _share(part: float, whole: float) -> str:
    share = part / max(whole, 1e-30)
    return f"{share:.1%}" if math.isfinite(share) else "an unbounded share"


def hide_once_per_step(stage, chosen, bound: float, windows: tuple, free, gap: float
                       ) -> tuple[Any, Any, float, float, str]:
    """The chain to keep where the schedule hides up to ``windows`` (UNSHARD, REDUCE_GRAD;
    seconds per microbatch) of the once-per-step collectives (this module's rule):
    ``chosen`` (a :class:`~autopp.sharding.chain.budget.Chain` planned at their full price, of
    ``stage``; ``bound``: its certified bound) where it is within ``gap`` of its bound
    (:data:`~autopp.sharding.chain.budget.CERTIFIED_GAP`) or the budget binds, else (its
    fastest plan fits) the faster by exposed time of it and ``free(chosen)``'s (the time-optimal chain of its policy with those
    collectives all but free, :data:`FREE_WEIGHT`: (stage, chain, or None where it does
    not fit)). Returns (stage, chain at full price, its certified bound at full price,
    seconds per microbatch hidden, a note for the plan where the choice is not certified
    within ``gap``)."""
    once = chain_once(chosen.results)
    time1 = exposed_time_s(chosen.time_s, once, windows)
    once_max = [sum(stage.reps[k].model.once_max_s[i] for k in stage.kinds) for i in (0, 1)]
    lower = bound_with_windows(bound, once_max, windows)
    keep = stage, chosen, bound, hidden_s(once, windows)
    if time1 - lower <= gap * time1:
        logger.debug("once-per-step collectives: %.4g s a microbatch hidden of %.4g; at most "
                     "%.4g s more could be: the plan stands", hidden_s(once, windows),
                     sum(once), hidden_s(once_max, windows) - hidden_s(once, windows))
        return *keep, ""
    if not chosen.free:
        return *keep, (f"once-per-step collectives: planned at full price under the budget; "
                       f"the schedule's windows could make a plan at most "
                       f"{_share(time1 - lower, time1)} faster (not searched)")
    stage0, chain0 = free(chosen)
    if chain0 is None:
        return *keep, ("once-per-step collectives: planned at full price (the fastest plan "
                       "with them free does not fit the budget)")
    once0 = chain_once(chain0.results)
    # chain0.time_s: t + FREE_WEIGHT × the collectives; its bound, less FREE_WEIGHT × the
    # most they cost, bounds t, hence T, over every plan (recomputing only adds time)
    time0 = chain0.time_s + (1 - FREE_WEIGHT) * sum(once0) - hidden_s(once0, windows)
    lower = max(lower, chain0.priced_bound_s - FREE_WEIGHT * sum(once_max))
    logger.info("once-per-step collectives (windows %s s a microbatch): planned at full "
                "price %.6g s exposed, with them free %.6g s exposed; bound %.6g s",
                tuple(f"{w:.4g}" for w in windows), time1, time0, lower)
    best = min(time0, time1)
    note = "" if best - lower <= gap * best else (
        f"once-per-step collectives: the plan's exposed time is within "
        f"{_share(best - lower, best)} of its bound (the windows' term is not linear)")
    if time0 >= time1 * (1 - _TIE):
        return *keep, note
    results = [at_full_price(r, FREE_WEIGHT) for r in chain0.results]
    full = dataclasses.replace(chain0, results=results, free=True,
                               time_s=sum(r.objective_s for r in results))
    return stage0, full, bound, hidden_s(once0, windows), note
