"""A stage's plan as a chain of unit plans under a memory budget and a recomputation policy.

:func:`choose_chain` picks one solution per position of the stage's distinct units
(:class:`Stage`). A stage of several units shares one budget through a Lagrangian price:
each unit is solved for time + λ × its counted bytes, the chain chosen by the same sum, and
λ searched for the fastest chain that fits (λ = 0 first: done if it fits; λ = ∞ next: least
memory, else the plan is infeasible and the error names the consumers). Why a price and not
a split of the budget: it moves memory to where it buys the most time, and the chosen plan
fits as a whole. :func:`_best_mix` re-chooses exactly over every unit solution met.

Invariant: each price gives a lower bound on every fitting chain (weak duality over the
solver's proven bounds); the search stops once its chain is within the stage's gap
(:attr:`Stage.gap`) of the best bound, else polishes units as MIPs under their share. The
bound is reported (``StagePlan.time_bound_s``). ``recompute="auto"`` keeps the fastest
policy that fits, per stage (the runtime splits a stage with one policy)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopp.sharding.chain.blocks import TracedBlock, chain_dp
from autopp.sharding.chain.mix import fastest_mix
from autopp.sharding.ilp.memory_row import MemorySpec
from autopp.sharding.chain.over_budget import over_budget_message
from autopp.sharding.ilp.solution import InfeasiblePlanError, SolveResult
from autopp.sharding.ilp.solver import BYTES_ONLY, Model
from autopp.tracing.units import Unit

logger = logging.getLogger(__name__)

MODES = ("none", "selective", "full")
"""The recomputation policies (``"auto"`` tries each)."""


CERTIFIED_GAP = 0.01
"""The default gap (:attr:`Stage.gap`): a budget-bound chain whose time is within this
fraction of the certified lower bound is kept as it is (the price search stops, no
polish)."""


# -- the stage as positions of distinct units ------------------------------------------------


@dataclass(slots=True)
class DistinctUnit:
    """A distinct unit of the stage: its trace, ILP model and candidate boundary pairs."""

    unit: Unit
    traced: TracedBlock
    model: Model
    mkey: tuple
    pairs: dict[tuple, tuple[dict, dict]]
    """(input placement, output placement) -> the solver's restrictions and their names."""
    fixed_key: tuple


@dataclass(slots=True)
class Stage:
    """What :func:`choose_chain` plans: the stage's units in order, each position an index
    into its distinct units, and the boundary placements its ends allow."""

    units: list[Unit]
    kinds: list[int]
    """Per position, the index of its distinct unit in :attr:`reps`."""
    reps: list[DistinctUnit]
    first_in: list[tuple]
    last_out: list[tuple]
    solved: list[tuple[int, float]]
    """(ILP variables of each model built, solve seconds of each solve)."""
    flat: bool
    solves: dict[tuple, Any] | None = None
    """Solutions by (unit, boundary pair, policy, price, budget), kept across ``plan_stage``
    calls (the planner's memo); None: not kept (a flat stage)."""
    gap: float | None = None
    """The certified gap the budget search stops at (``StageRequest.optimality_gap``);
    None: :data:`CERTIFIED_GAP`."""


@dataclass(slots=True)
class Chain:
    """A chosen plan of the stage under one recomputation policy."""

    recompute: str
    results: list[SolveResult]
    """Per position."""
    pairs: list[tuple]
    """Per position: its (input, output) boundary placements."""
    time_s: float
    memory_bytes: float
    price: float = 0.0
    free: bool = False
    """The time-optimal chain, which fits: the budget does not bind."""
    priced_bound_s: float = -math.inf
    """A proven lower bound of the least Σ(time + price × bytes) over all chains (from the
    solves' bounds)."""
    bound_s: float = -math.inf
    """A proven lower bound on the time of every chain under this policy that fits the
    budget (the best over the prices searched); ``time_s`` where the budget does not bind
    and the solves were exact."""
    priced_ilp_bound_s: float = -math.inf
    ilp_bound_s: float = -math.inf
    """As :attr:`priced_bound_s` and :attr:`bound_s`, in the ILP's own accounting (not
    moved down by its over-count): what any ILP solve, a polish included, can reach at best;
    the search's stopping rule and the polish's decision use it."""
    memory_bound_bytes: float = math.nan
    """Of a least-memory chain that does not fit: a proven lower bound on the counted
    bytes of every chain under its policy, where the bytes-only LP relaxations proved it
    over the budget (:func:`_least_bytes_bound`) and the least-memory MIPs were skipped."""

    def total(self, attr: str) -> float:
        return sum(getattr(r, attr) for r in self.results)


# -- the chain at a price, the price search, the policy --------------------------------------


class _Priced:
    """A unit's solution as :func:`chain_dp` sees it: time + price × counted bytes."""

    __slots__ = ("objective_s", "res")

    def __init__(self, res: SolveResult, price: float):
        self.res = res
        if math.isinf(price):
            self.objective_s = res.memory_bytes + 1e-6 * res.objective_s
        else:
            self.objective_s = res.objective_s + price * res.memory_bytes


class _Bound:
    """A unit's lower bound as :func:`chain_dp` sees it: the solver's proven bound, moved
    down by what the ILP counts above the evaluated time and memory at its solution (the
    selective policy's memory row over-counts a few percent), never above the solution."""

    __slots__ = ("objective_s",)

    def __init__(self, priced: _Priced, shifted: bool = True):
        res = priced.res
        b, over = res.bound_s, res.ilp_value_s - priced.objective_s
        if b != b:
            self.objective_s = -math.inf
        elif not shifted:
            self.objective_s = b
        else:
            self.objective_s = min(priced.objective_s, b - max(over, 0.0) if over == over else b)


POLISH_TIME_S = 10.0
"""Wall-clock bound of one polish's MIP, beside :data:`POLISH_NODES` (a large block's LPs
make each node slow). The plan it returns then depends on the machine's speed (rank 0
plans and broadcasts, and the plan is cached, so a job's ranks agree); it is never worse
than its start."""

_POLISH_GAP = CERTIFIED_GAP / 2
"""Relative MIP gap of a polish at the default gap."""


def certified_gap(stage: Stage) -> float:
    """The gap ``stage``'s plan must be proven within (:attr:`Stage.gap`, else the default)."""
    return CERTIFIED_GAP if stage.gap is None else stage.gap


def _polish_gap(stage: Stage) -> float:
    """Relative MIP gap of a polish: it only has to bring its chain within the stage's gap."""
    return _POLISH_GAP if stage.gap is None else stage.gap / 2

POLISH_TARGET = True
"""A polish's MIP stops at its first plan whose time brings the chain within
:func:`_polish_gap` of the chain's bound (HiGHS's ``objective_target``): that bound, from
the price search over the whole chain, is far stronger than the MIP's own LP bound, so the
MIP's own gap would not close within its limits. False: each MIP runs to its own gap."""

POLISH_NODES = 60
"""Branch-and-bound nodes a polish's MIP may take (deterministic, unlike a time limit). It
starts from the fastest known plan that fits its share (:func:`_start_within`), so it
returns that plan or a better one. A block's MIP under its share has a weak LP bound, so
more nodes prove little; the finer price search (:data:`_PRICE_TOLERANCE`) closes those gaps
instead."""


_SEARCH_GAP = 1e-3
"""Relative MIP gap of the price search's solves at a positive price (intermediate: the
chosen chain is polished at the solver's default gap)."""

# The price search's solves at a positive price take the LP relaxation's rounding where it
# is not integral (``Model.solve(round_fractional=True)``) rather than a MIP: the LP's
# optimum is still a proven bound, so the certificate holds, and the rounded plan is a real
# one. Such MIPs take seconds each on large models and buy nothing the polish would not.


def _solve(stage: Stage, kind: int, pair: tuple, mode: str, price: float,
           budget: float | None, time_limit_s: float, start=None,
           target_s: float | None = None, rounded: bool = False
           ) -> SolveResult | InfeasiblePlanError:
    rep = stage.reps[kind]
    rounded = rounded or 0 < price < math.inf
    key = (rep.mkey, pair, rep.fixed_key, time_limit_s, mode, price, budget, target_s,
           rounded, stage.gap)
    res = None if stage.solves is None else stage.solves.get(key)
    if res is None:
        # the price search's intermediate solves; a polish, which only has to bring its
        # chain within the certified gap; the exact solves
        gap = _SEARCH_GAP if 0 < price < math.inf else _polish_gap(stage) \
            if budget is not None else 1e-6
        try:
            res = rep.model.solve(*rep.pairs[pair], time_limit_s=time_limit_s,
                                  recompute=mode, budget=budget, price=price, start=start,
                                  rel_gap=gap,
                                  max_nodes=None if budget is None else POLISH_NODES,
                                  round_fractional=rounded,
                                  objective_target_s=target_s)
            stage.solved.append((0, res.solve_s))
        except InfeasiblePlanError as e:
            res = e
        if stage.solves is not None:
            stage.solves[key] = res
    return res


def _chain(stage: Stage, mode: str, price: float, time_limit_s: float,
           budget: float | None = None, seen: dict | None = None,
           rounded: bool = False) -> Chain:
    """The best chain at ``price`` (seconds per counted byte; inf: least memory).
    ``seen``: collects every unit solution solved, by (unit, boundary pair). ``rounded``:
    each unit's LP relaxation rounded where fractional, not its MIP (as the price search's
    solves at a positive price always are)."""
    table: dict[int, dict[tuple, _Priced]] = {}
    for kind, rep in enumerate(stage.reps):
        table[kind], errors = {}, []
        for pair in rep.pairs:
            res = _solve(stage, kind, pair, mode, price, budget, time_limit_s,
                         rounded=rounded)
            if isinstance(res, InfeasiblePlanError):
                errors.append(str(res))
            else:
                table[kind][pair] = _Priced(res, price)
                if seen is not None:
                    seen.setdefault((kind, pair), {})[res.objective_s, res.memory_bytes] = res
        if not table[kind]:
            detail = errors[0] if errors else "no boundary placement fits its shapes"
            if stage.flat:
                raise InfeasiblePlanError(detail)
            raise InfeasiblePlanError(f"unit {rep.unit.name} has no feasible plan: {detail}")
    pairs = chain_dp(stage.kinds, table, stage.first_in, stage.last_out)
    results = [table[k][pair].res for k, pair in zip(stage.kinds, pairs)]
    chain = Chain(mode, results, pairs, sum(r.objective_s for r in results),
                  sum(r.memory_bytes for r in results), price)
    if not math.isinf(price):
        for shifted in (True, False):
            bounds = {k: {pair: _Bound(v, shifted) for pair, v in row.items()}
                      for k, row in table.items()}
            low = chain_dp(stage.kinds, bounds, stage.first_in, stage.last_out)
            value = sum(bounds[k][pair].objective_s for k, pair in zip(stage.kinds, low))
            if shifted:
                chain.priced_bound_s = value
            else:
                chain.priced_ilp_bound_s = value
    return chain


class _Low:
    """A unit's proven lower bound as :func:`chain_dp` sees it."""

    __slots__ = ("objective_s",)

    def __init__(self, value: float):
        self.objective_s = value


def _least_bytes_bound(stage: Stage, mode: str, time_limit_s: float, least: Chain) -> float:
    """A proven lower bound on the counted bytes of every chain under ``mode``: each unit's
    bytes-only LP relaxation's optimum (integral or not, it bounds every plan of the
    unit's memory row), moved down by what the row counts above the evaluated bytes, as
    :class:`_Bound` moves time bounds (at the relaxation's solution where it is integral,
    else at the unit's solution in ``least``); ``-inf`` where neither says, or a unit has
    no plan."""
    def over(res: SolveResult) -> float:
        return res.ilp_memory_bytes - res.memory_bytes  # nan: a rounded relaxation's

    known = {k: over(r) for k, r in zip(stage.kinds, least.results) if over(r) == over(r)}
    table: dict[int, dict[tuple, _Low]] = {}
    for kind, rep in enumerate(stage.reps):
        table[kind] = {}
        for pair in rep.pairs:
            res = _solve(stage, kind, pair, mode, BYTES_ONLY, None, time_limit_s,
                         rounded=True)
            if isinstance(res, InfeasiblePlanError):
                continue
            counted_over = over(res) if over(res) == over(res) else known.get(kind)
            low = res.memory_bound_bytes
            if low != low or counted_over is None:
                return -math.inf
            table[kind][pair] = _Low(min(res.memory_bytes, low - max(counted_over, 0.0)))
        if not table[kind]:
            return -math.inf
    low_pairs = chain_dp(stage.kinds, table, stage.first_in, stage.last_out)
    return sum(table[k][pair].objective_s for k, pair in zip(stage.kinds, low_pairs))


def _best_mix(stage: Stage, best: Chain, seen: dict, budget: float) -> Chain:
    """The fastest chain that fits ``budget`` over every unit solution met (``seen``, by
    (unit, boundary pair)) and every chain of boundary placements
    (:func:`~autopp.sharding.chain.mix.fastest_mix`); ``best`` where nothing faster fits."""
    mixed = fastest_mix(stage.kinds, [rep.pairs for rep in stage.reps], stage.first_in,
                        stage.last_out, seen, budget, best.time_s * (1 - 1e-9),
                        best.results, best.pairs)
    if mixed is None:
        return best
    results, pairs = mixed
    return Chain(best.recompute, results, pairs, sum(r.objective_s for r in results),
                 sum(r.memory_bytes for r in results), best.price, False, best.priced_bound_s,
                 priced_ilp_bound_s=best.priced_ilp_bound_s)


def chain_at_price(stage: Stage, mode: str, price: float, time_limit_s: float) -> Chain:
    """The best chain of ``stage`` under ``mode`` for time + ``price`` × counted bytes."""
    return _chain(stage, mode, price, time_limit_s)


@dataclass(slots=True)
class _Searched:
    """One policy after its price search: the fastest fitting chain found (None: none
    fits), the least-memory chain, the bound, and every unit solution met."""

    mode: str
    fit: Chain | None
    least: Chain
    seen: dict


def _search_mode(stage: Stage, mode: str, budget: float | None, time_limit_s: float,
                 fast: Chain, incumbent: float = math.inf) -> _Searched:
    """The price search of one policy (no polish: :func:`_close_gap`). ``fast``: the
    policy's chain at price 0. ``incumbent``: the time of a fitting chain already found
    (another policy's): once this policy's bound reaches it, the search stops with the best
    it holds."""
    fast.bound_s, fast.ilp_bound_s = fast.priced_bound_s, fast.priced_ilp_bound_s
    if budget is None or fast.memory_bytes <= budget:
        fast.free = True
        return _Searched(mode, fast, fast, {})
    # least memory from the LP relaxations rounded first: where that plan fits, it is the
    # search's feasible start (a split backward's peaks, a max over two terms, leave those
    # LPs fractional, and their MIPs are slow)
    least = _chain(stage, mode, math.inf, time_limit_s, rounded=True)
    if least.memory_bytes > budget:
        # before the least-memory MIPs (slow on large models): where the bytes-only LP
        # relaxations already prove that no chain fits, the policy is out
        proven = _least_bytes_bound(stage, mode, time_limit_s, least)
        if proven > budget:
            least.memory_bound_bytes = proven
            return _Searched(mode, None, least, {})
        least = _chain(stage, mode, math.inf, time_limit_s)
    if least.memory_bytes > budget:
        # the time tie-break may have traded bytes for time: fits or not is the memory
        # row's alone
        least = _chain(stage, mode, BYTES_ONLY, time_limit_s)
        if least.memory_bytes > budget:
            return _Searched(mode, None, least, {})
    # Lagrangian price: geometric search between an infeasible and a feasible price
    best, lo, hi, bound = least, 0.0, math.inf, fast.priced_bound_s
    ilp_bound = fast.priced_ilp_bound_s
    seen: dict = {}
    for r, pair, kind in zip(least.results, least.pairs, stage.kinds):
        seen.setdefault((kind, pair), {})[r.objective_s, r.memory_bytes] = r
    price = fast.time_s / max(fast.memory_bytes, 1.0)
    for _ in range(_PRICE_STEPS):
        c = _chain(stage, mode, price, time_limit_s, seen=seen)
        bound = max(bound, c.priced_bound_s - price * budget)
        ilp_bound = max(ilp_bound, c.priced_ilp_bound_s - price * budget)
        if c.memory_bytes <= budget:
            hi = price
            if c.time_s < best.time_s:
                best = c
        else:
            lo = price
        best = _best_mix(stage, best, seen, budget)
        if ilp_bound >= incumbent or best.time_s - bound <= certified_gap(stage) * best.time_s:
            break  # no solve can beat the other policy's chain, or certified close enough
        if math.isinf(hi):
            price *= 8
        elif lo == 0.0:
            price /= 8
        elif hi / lo < _PRICE_TOLERANCE:
            break
        else:
            price = math.sqrt(lo * hi)
    best.bound_s, best.ilp_bound_s = bound, ilp_bound
    return _Searched(mode, best, least, seen)


def _close_gap(stage: Stage, s: _Searched, budget: float, incumbent: float,
               time_limit_s: float) -> None:
    """Polish ``s``'s chain where its gap to its bound exceeds the stage's gap and
    its bound is more than that below ``incumbent`` (the fastest fitting chain of any
    policy): otherwise the incumbent is already within the gap of anything it could give."""
    best = s.fit
    if best is None or best.free:
        return
    if best.ilp_bound_s >= incumbent * (1 - certified_gap(stage)) or (
            best.time_s - best.ilp_bound_s <= certified_gap(stage) * best.time_s):
        logger.debug("recompute=%s under %.4g bytes: not polished: %.6g s, the ILP's bound "
                     "%.6g s (gap %.2f%%), bound %.6g s (gap %.2f%%), fastest other %.6g s",
                     s.mode, budget, best.time_s, best.ilp_bound_s,
                     100 * (best.time_s - best.ilp_bound_s) / best.time_s, best.bound_s,
                     100 * (best.time_s - best.bound_s) / best.time_s, incumbent)
        return  # a polish (an ILP solve) cannot gain more than the gap
    searched = best.time_s
    best = _best_mix(stage, _polish(stage, s.mode, budget, best, time_limit_s, s.seen),
                     s.seen, budget)
    best.bound_s, best.ilp_bound_s = s.fit.bound_s, s.fit.ilp_bound_s
    logger.debug("recompute=%s under %.4g bytes: price search %.6g s, polished %.6g s, "
                 "bound %.6g s (gap %.2f%%; the ILP's %.6g s), fastest other %.6g s", s.mode,
                 budget, searched, best.time_s, best.bound_s,
                 100 * (best.time_s - best.bound_s) / best.time_s, best.ilp_bound_s, incumbent)
    s.fit = best


_PRICE_TOLERANCE = 1.05
"""The price search stops when the feasible and infeasible prices are this close (a factor).
Each step re-solves every unit at a price (LPs whose relaxation is integral, so cheap)
and adds its solutions to the mix, which is what closes the gap
where identical blocks share the budget; :func:`_polish` is left the rest."""

_PRICE_STEPS = 24
"""At most this many prices per policy (the bisection's steps included)."""


def _polish(stage: Stage, mode: str, budget: float, best: Chain, time_limit_s: float,
            seen: dict) -> Chain:
    """Close the price's gap: the positions of each distinct unit on each boundary pair
    (the most time first) are solved again with the budget in the row, as what the other
    positions leave divided by their count, from the current plan as a MIP start (its
    solutions join ``seen``). Each MIP stops at its first plan that brings the chain within
    :func:`_polish_gap` of the chain's bound (:data:`POLISH_TARGET`), and the polish stops
    once the chain is within the stage's gap of it."""
    groups: dict[tuple, list[int]] = {}  # (distinct unit, boundary pair) -> positions
    for i, (kind, pair) in enumerate(zip(stage.kinds, best.pairs)):
        groups.setdefault((kind, pair), []).append(i)
    by_time = sorted(groups, key=lambda g: -sum(best.results[i].objective_s
                                                  for i in groups[g]))
    bound_s = best.ilp_bound_s
    goal_s = bound_s / (1 - _polish_gap(stage))  # the chain's time a polish aims at
    for kind, pair in by_time:
        if best.time_s - bound_s <= certified_gap(stage) * best.time_s:
            break  # certified
        at = groups[kind, pair]
        others = sum(r.memory_bytes for i, r in enumerate(best.results) if i not in at)
        share = (budget - others) / len(at)
        start = _start_within(share, [best.results[i] for i in at],
                              seen.get((kind, pair), {}).values())
        others_s = sum(r.objective_s for i, r in enumerate(best.results) if i not in at)
        target = (goal_s - others_s) / len(at) if POLISH_TARGET and math.isfinite(
            goal_s) else None
        res = _solve(stage, kind, pair, mode, 0.0, share, min(time_limit_s, POLISH_TIME_S),
                     start=None if start is None else start.choice, target_s=target)
        logger.debug("polish of %s x%d under %.4g bytes each: start %s, target %s: %s",
                     stage.reps[kind].unit.name, len(at), share,
                     "none" if start is None else f"{start.objective_s:.6g} s",
                     "none" if target is None else f"{target:.6g} s",
                     res if isinstance(res, InfeasiblePlanError) else
                     f"{res.objective_s:.6g} s in {res.solve_s:.1f} s ({res.status})")
        if isinstance(res, InfeasiblePlanError) or res.memory_bytes > share:
            continue
        seen.setdefault((kind, pair), {})[res.objective_s, res.memory_bytes] = res
        if res.objective_s * len(at) >= sum(best.results[i].objective_s for i in at) * (
                1 - 1e-9):
            continue
        results = [res if i in at else r for i, r in enumerate(best.results)]
        best = Chain(mode, results, best.pairs, sum(r.objective_s for r in results),
                      sum(r.memory_bytes for r in results), best.price, best.free,
                      best.priced_bound_s, priced_ilp_bound_s=best.priced_ilp_bound_s)
    return best


def _start_within(share: float, *groups) -> SolveResult | None:
    """The fastest known solution whose memory, as the ILP's row counts it, fits ``share``:
    the polish's MIP start. A start over the share is no start: HiGHS drops an infeasible
    one and searches from nothing."""
    fits = [r for g in groups for r in g
            if (r.ilp_memory_bytes if r.ilp_memory_bytes == r.ilp_memory_bytes
                else r.memory_bytes) <= share]
    return min(fits, key=lambda r: r.objective_s, default=None)


def choose_chain(stage: Stage, modes: Sequence[str], budget: float | None,
                 memory: MemorySpec, time_limit_s: float
                 ) -> tuple[Chain, list[tuple[str, Chain | None, Chain]], float]:
    """The fastest fitting chain over ``modes``; (mode, fitting chain, least-memory chain)
    of each mode tried; and a lower bound on the time of every fitting chain under any of
    ``modes`` (``-inf`` where a solve proved none).

    Every policy's price search runs before any polish, and only the policies whose bound
    is below the fastest fitting chain found are polished, the most promising first."""
    searched: list[_Searched] = []
    best: Chain | None = None
    bounds: list[float] = []
    for mode in modes:
        fast = _chain(stage, mode, 0.0, time_limit_s)
        if best is not None and fast.time_s >= best.time_s:
            bounds.append(fast.priced_bound_s)
            continue  # its fastest plan, fitting or not, is no faster than one that fits
        s = _search_mode(stage, mode, budget, time_limit_s, fast,
                         incumbent=math.inf if best is None else best.time_s)
        searched.append(s)
        if s.fit is not None and (best is None or s.fit.time_s < best.time_s):
            best = s.fit
        if mode == "none" and s.fit is not None and s.fit.free:
            break  # the time-optimal plan fits: recomputing could only add time
    for s in sorted((s for s in searched if s.fit is not None),
                    key=lambda s: s.fit.ilp_bound_s):
        _close_gap(stage, s, budget, best.time_s, time_limit_s)
        if s.fit.time_s < best.time_s:
            best = s.fit
    bounds += [math.inf if s.fit is None else s.fit.bound_s for s in searched]  # none fits
    tried = [(s.mode, s.fit, s.least) for s in searched]
    fits = [fit for _, fit, _ in tried if fit is not None]
    if not fits:
        # the message names the least-memory plan's consumers: solve it where the LP
        # bound skipped it
        tried = [(m, fit, least if math.isnan(least.memory_bound_bytes)
                  else _chain(stage, m, BYTES_ONLY, time_limit_s))
                 for m, fit, least in tried]
        others = []
        if memory.counts_activations:  # what the other policies would need, for the message
            others = [(m, _chain(stage, m, math.inf, time_limit_s)) for m in MODES
                      if m not in modes]
        raise InfeasiblePlanError(over_budget_message(stage, budget, memory, tried, others))
    return min(fits, key=lambda c: c.time_s), tried, min(bounds)
