"""HiGHS as the sharding planner runs it: the lazy import, a banner-free instance, and one
LP or MIP run with the LP relaxations kept warm (:class:`WarmLps`).

Why warm: a budget search solves one unit's LP many times with only some numbers changed
(its costs between memory prices, its column bounds between boundary pairs, the memory
row's bound for a polish, the memory row's coefficients between stages that keep another
number of microbatches in flight); HiGHS re-solves such an LP from its last optimal basis
in a fraction of a cold solve's time. Not always: a warm re-solve occasionally stalls, so
it gets a bounded share of its cold solve's time and then starts cold (:data:`WARM_GUARD`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import numpy as np

from autopp.sharding.plan import NEAR_OPTIMAL

_BANNER_SHOWN = False


def highspy():
    """highspy, imported on first use: a process that only applies a saved plan
    (``plan=``, e.g. on a machine without HiGHS) never needs it."""
    try:
        import highspy as h
    except ImportError as e:
        raise ImportError("autopp's planner solves with HiGHS: pip install highspy (running "
                          "a saved plan, plan=..., does not need it)") from e
    return h


def new_highs() -> Any:
    """A HiGHS instance. The first one a process creates prints HiGHS's banner on the C
    stdout before any option can be set; that one is created with fd 1 pointed at
    /dev/null, so every rank of a job does not print it."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return highspy().Highs()
    _BANNER_SHOWN = True
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        return highspy().Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def after_fork() -> None:
    """In a forked child: a fresh HiGHS thread pool. The parent's pool (made by its first
    run with ``threads`` > 1) is process-wide state whose worker threads a fork does not
    copy; ``resetGlobalScheduler`` drops it without waiting for them, and the next run
    starts its own."""
    if "highspy" in sys.modules:
        highspy().Highs.resetGlobalScheduler(False)


WARM_GUARD = (2.0, 0.25)
"""A warm re-solve's time limit: this many times the cold solve of the same LP, and at
least this many seconds; past it the LP is solved cold."""

FIX_GAP = 1e-3
"""A time-only solve's plan from :meth:`WarmLps.fix_and_solve` is taken where it is within
this fraction of its LP relaxation's optimum (0.1%: inside the planner's 1% certified gap
and its cost model's error); otherwise the whole MIP is solved. A tighter threshold sends
fixed plans that are already the MIP's optimum to the much slower whole MIP."""


class WarmLps:
    """Solved LP relaxations by key (one per recomputation policy and LP structure), shared
    by a unit's models under every memory accounting."""

    LIMIT = 8
    """LP relaxations kept (one per recomputation policy in use, with room to spare)."""

    def __init__(self) -> None:
        self._lps: dict[tuple, tuple] = {}

    def fix_and_solve(self, lp, upper, integer: list[bool], x_lp: np.ndarray,
                      lp_bound: float, time_limit_s: float, threads: int, *, scale: float,
                      rel_gap: float) -> tuple[np.ndarray, float, str, float] | None:
        """A time-only solve whose LP relaxation (``x_lp``, optimum ``lp_bound``) is
        fractional: every integer column the relaxation left at 0 is fixed there and the
        rest is solved as a MIP (HiGHS's presolve removes the fixed columns: a few dozen
        integer columns stay of thousands). Its plan is taken, with the relaxation's
        optimum as its proven bound, where it is within :data:`FIX_GAP` (or ``rel_gap``,
        if looser) of that bound; None otherwise (the caller solves the whole MIP), which
        is several times slower for the same plan. Returns (x, seconds, status, objective)
        as :meth:`run` does."""
        t0 = time.perf_counter()
        ints = np.asarray(integer, dtype=bool)
        fixed = np.asarray(upper, dtype=np.float64).copy()
        fixed[ints & (x_lp <= 1e-6)] = 0.0
        x, _, status, obj, _ = self.run(lp, fixed, integer, True, time_limit_s, threads,
                                        scale=scale, rel_gap=rel_gap)
        if x.size == 0 or obj - lp_bound > max(FIX_GAP, rel_gap) * abs(obj):
            return None
        return (x, time.perf_counter() - t0, f"{status} ({NEAR_OPTIMAL} "
                f"{max(FIX_GAP, rel_gap):g} of its LP relaxation: the relaxation's integral "
                "columns fixed, the rest solved as a MIP)", obj)

    def run(self, lp, upper, integer: list[bool], as_mip: bool, time_limit_s: float,
            threads: int, *, scale: float, hint=None, rel_gap: float = 1e-6,
            warm: tuple | None = None, max_nodes: int | None = None,
            mem_row: tuple | None = None, objective_target: float | None = None,
            coefs: tuple[tuple[int, int, float], ...] = (), presolve: bool = True):
        """Solve ``lp`` (objective in units of 1/``scale`` seconds) under column upper
        bounds ``upper``. ``warm``: the key of an LP relaxation to re-solve from its last
        basis, its costs, column bounds, budget and memory row ``mem_row`` ((columns, MiB
        per column), the last row) set anew; kept for the next call. ``max_nodes``: a MIP's
        branch-and-bound node limit. ``objective_target``: a MIP stops at the first solution
        whose objective (seconds) is at most this (HiGHS's ``objective_target``), before its
        gap closes. ``coefs``: other (row, column, value) entries set anew on a warm LP (a
        split backward's peak rows). ``presolve``: False runs a cold solve without HiGHS's
        presolve: the planner's time-only MIPs close at their root, where presolve costs
        about half their time for the same optimum (``benchmarks/probe_time.py``); a
        polish's MIP branches, and keeps it. Returns (x, seconds, status, objective,
        proven lower bound of the objective); x is empty where no solution was found."""
        t0 = time.perf_counter()
        h, last_upper, last_mem, cold_s, last_coefs = self._lps.get(
            warm, (None,) * 5) if warm else (None,) * 5
        row = len(lp.row_upper_) - 1  # the memory row: the budget (inf: none)
        guard, hit = time_limit_s, h is not None
        if hit:
            cols = np.arange(len(lp.col_cost_), dtype=np.int32)
            guard = min(time_limit_s, max(WARM_GUARD[0] * cold_s, WARM_GUARD[1]))
            # HiGHS measures its time limit from the instance's first run, not this one
            # (ERGO-Code/HiGHS#1477): a warm LP would hit it after a minute of solves
            h.setOptionValue("time_limit", h.getRunTime() + float(guard))
            h.changeColsCost(len(cols), cols, np.asarray(lp.col_cost_, dtype=np.float64))
            if not np.array_equal(upper, last_upper):  # another boundary pair's restrictions
                h.changeColsBounds(len(cols), cols, np.zeros(len(cols)),
                                   np.asarray(upper, dtype=np.float64))
            if mem_row is not None and last_mem is not None and not (
                    np.array_equal(mem_row[0], last_mem[0])
                    and np.array_equal(mem_row[1], last_mem[1])):  # another activation factor
                new = dict(zip(mem_row[0].tolist(), mem_row[1].tolist()))
                for c in set(last_mem[0].tolist()) | set(new):
                    h.changeCoeff(row, c, new.get(c, 0.0))
            if coefs != last_coefs:  # another stage's peaks
                for r, c, v in coefs:
                    h.changeCoeff(r, c, v)
            h.changeRowBounds(row, float(lp.row_lower_[row]), float(lp.row_upper_[row]))
            self._lps[warm] = (h, upper, mem_row, cold_s, coefs)
        else:
            lp.col_upper_ = upper
            kint, kcont = highspy().HighsVarType.kInteger, highspy().HighsVarType.kContinuous
            lp.integrality_ = [kint if b else kcont for b in integer] if as_mip else []
            h = new_highs()
            h.setOptionValue("output_flag", False)
            h.setOptionValue("time_limit", float(time_limit_s))
            h.setOptionValue("threads", int(threads))
            h.setOptionValue("mip_rel_gap", float(rel_gap))
            h.setOptionValue("mip_heuristic_effort", 0.3)  # finds incumbents sooner
            if max_nodes is not None:
                h.setOptionValue("mip_max_nodes", int(max_nodes))
            if objective_target is not None and as_mip:
                h.setOptionValue("objective_target", float(objective_target) * scale)
            if not presolve:
                h.setOptionValue("presolve", "off")
            h.passModel(lp)
            if hint is not None:
                h.setSolution(len(hint[0]), *hint)
        h.run()
        if hit and guard < time_limit_s and (
                h.getModelStatus() == highspy().HighsModelStatus.kTimeLimit):
            del self._lps[warm]  # a warm start gone astray: solve it cold, as if new
            x, _, status, obj, bound = self.run(
                lp, upper, integer, as_mip, time_limit_s, threads, scale=scale, hint=hint,
                rel_gap=rel_gap, warm=warm, max_nodes=max_nodes, mem_row=mem_row,
                objective_target=objective_target, coefs=coefs, presolve=presolve)
            return x, time.perf_counter() - t0, status + " (warm start dropped)", obj, bound
        if warm is not None and cold_s is None:
            if len(self._lps) >= self.LIMIT:
                self._lps.pop(next(iter(self._lps)))
            self._lps[warm] = (h, upper, mem_row, time.perf_counter() - t0, coefs)
        if h.getModelStatus() == highspy().HighsModelStatus.kInfeasible:
            # HiGHS's presolve can call a feasible model infeasible when its values span
            # many orders of magnitude (a dp=512 head's 2 TiB replicated logits beside 1-byte
            # terms); solving again without presolve settles it
            h.setOptionValue("presolve", "off")
            h.run()
        dt = time.perf_counter() - t0
        status = h.modelStatusToString(h.getModelStatus())
        sol = h.getSolution()
        infeasible = h.getModelStatus() in (highspy().HighsModelStatus.kInfeasible,
                                            highspy().HighsModelStatus.kUnboundedOrInfeasible)
        if not sol.value_valid or infeasible:
            # a warm-started LP proven infeasible under new bounds still holds the last
            # call's solution as "valid": it is not a solution of this one
            return np.zeros(0), dt, status, 0.0, -math.inf
        info = h.getInfo()
        obj = info.objective_function_value / scale
        # a MIP run proves its dual bound; an LP run's optimum bounds the MIP's
        if as_mip:
            bound = min(obj, info.mip_dual_bound / scale)
        elif h.getModelStatus() == highspy().HighsModelStatus.kOptimal:
            bound = obj
        else:
            bound = -math.inf
        return np.asarray(sol.col_value), dt, status, obj, bound

