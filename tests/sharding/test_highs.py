"""The planner's HiGHS runs (autopp.sharding.ilp.highs): warm re-solves honour their own time
limit, and a warm start that runs past its guard is solved again cold."""

from __future__ import annotations

import numpy as np
import pytest

from autopp.sharding.ilp import highs


def _lp(n: int = 400, m: int = 300, seed: int = 0):
    """min c.x s.t. A x >= 1 (rows), 0 <= x <= 1; the last row stands for the memory row."""
    rng = np.random.default_rng(seed)
    a = (rng.random((m, n)) < 0.05) * rng.random((m, n))
    a[np.arange(m), rng.integers(0, n, m)] += 1.0  # every row coverable
    lp = highs.highspy().HighsLp()
    lp.num_col_, lp.num_row_ = n, m
    lp.col_cost_ = rng.random(n) + 0.1
    lp.col_lower_ = np.zeros(n)
    lp.row_lower_ = np.ones(m)
    lp.row_upper_ = np.full(m, np.inf)
    rows, cols = np.nonzero(a)
    lp.a_matrix_.format_ = highs.highspy().MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.searchsorted(rows, np.arange(m + 1)).astype(np.int32)
    lp.a_matrix_.index_ = cols.astype(np.int32)
    lp.a_matrix_.value_ = a[rows, cols].astype(np.float64)
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, m
    return lp, rng


def _cold(lp, upper):
    x, _, status, obj, _ = highs.WarmLps().run(lp, upper, [False] * len(upper), False, 60.0, 2,
                                              scale=1.0)
    assert status == "Optimal"
    return obj


def test_a_warm_resolve_gets_its_own_time_limit_not_the_instances_total():
    """HiGHS counts a time limit from an instance's first run (ERGO-Code/HiGHS#1477). Here
    the warm re-solve's limit is below the time the instance has already run: counted from
    the first run it would stop before its first iteration."""
    lp, rng = _lp()
    upper = np.ones(lp.num_col_)
    warm = highs.WarmLps()
    for _ in range(30):  # the instance's clock runs well past the limit below
        lp.col_cost_ = rng.random(lp.num_col_) + 0.1
        _, dt, status, _, _ = warm.run(lp, upper, [False] * len(upper), False, 60.0, 2,
                                       scale=1.0, warm=("k",))
        assert status == "Optimal"
    (h, *_), = warm._lps.values()
    limit = h.getRunTime() / 2
    lp.col_cost_ = rng.random(lp.num_col_) + 0.1  # a re-solve of ~0.02 s
    _, _, status, obj, _ = warm.run(lp, upper, [False] * len(upper), False, limit, 2,
                                    scale=1.0, warm=("k",))
    assert status == "Optimal"
    assert obj == pytest.approx(_cold(lp, upper), rel=1e-9)


def test_a_warm_start_past_its_guard_is_solved_cold(monkeypatch):
    lp, rng = _lp(seed=1)
    upper = np.ones(lp.num_col_)
    warm = highs.WarmLps()
    warm.run(lp, upper, [False] * len(upper), False, 60.0, 2, scale=1.0, warm=("k",))
    monkeypatch.setattr(highs, "WARM_GUARD", (0.0, 0.0))  # every warm start times out
    lp.col_cost_ = rng.random(lp.num_col_) + 0.1
    upper[::7] = 0.0  # another boundary pair's restrictions
    _, _, status, obj, bound = warm.run(lp, upper, [False] * len(upper), False, 60.0, 2,
                                        scale=1.0, warm=("k",))
    assert status == "Optimal (warm start dropped)"
    assert obj == pytest.approx(_cold(lp, upper), rel=1e-9) and bound == obj
    # the cold solve is the key's warm LP now, with its own cold time as the guard's base
    assert len(warm._lps) == 1 and list(warm._lps.values())[0][3] > 0


def _choice_mip(groups: int = 40, options: int = 6, scale: float = 1e3):
    """One option per group (rows = 1), minimising time (seconds × ``scale`` in the LP, as
    the planner scales its objective) under a memory row: the shape of a unit's ILP."""
    rng = np.random.default_rng(0)
    n = groups * options
    time_s, mem = rng.uniform(1, 2, n), rng.uniform(1, 3, n)
    lp = highs.highspy().HighsLp()
    lp.num_col_, lp.num_row_ = n, groups + 1
    lp.col_cost_ = time_s * scale
    lp.col_lower_ = np.zeros(n)
    index = np.stack([np.arange(n) // options, np.full(n, groups)], 1).ravel()
    lp.a_matrix_.format_ = highs.highspy().MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.arange(0, 2 * n + 1, 2).astype(np.int32)
    lp.a_matrix_.index_ = index.astype(np.int32)
    lp.a_matrix_.value_ = np.stack([np.ones(n), mem], 1).ravel()
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, groups + 1
    lp.row_lower_ = np.r_[np.ones(groups), -np.inf]
    lp.row_upper_ = np.r_[np.ones(groups), 1.6 * groups]
    return lp, n


def test_a_mip_stops_at_its_objective_target():
    """A polish's MIP stops at its first solution at or below the target (in seconds: the
    LP's objective is scaled), before proving its own gap; without one it runs to its
    optimum. Measured on this MIP: first solution 48.306 s, optimum 48.2431 s."""
    lp, n = _choice_mip()
    run = dict(upper=np.ones(n), integer=[True] * n, as_mip=True, time_limit_s=60.0,
               threads=2, scale=1e3)  # HiGHS's thread pool is process-wide: as the planner
    _, _, status, optimum, bound = highs.WarmLps().run(lp, **run)
    assert status == "Optimal" and bound == pytest.approx(optimum, rel=1e-4)
    target = optimum * 1.01
    x, _, status, obj, bound = highs.WarmLps().run(lp, **run, objective_target=target)
    assert status == "Target for objective reached", status
    assert optimum <= obj <= target and bound <= optimum + 1e-9
    assert x.size == n  # the solution is returned


def test_a_mip_without_presolve_reaches_the_same_optimum():
    """The planner's time-only MIPs run without HiGHS's presolve (half their time on the
    70B/512 probes, benchmarks/probe_time.py). Presolve only speeds the search: the optimum, proven at the same gap, is the
    one a presolved run proves (48.2431 s on this MIP)."""
    lp, n = _choice_mip()
    run = dict(upper=np.ones(n), integer=[True] * n, as_mip=True, time_limit_s=60.0,
               threads=2, scale=1e3)
    x, _, status, optimum, _ = highs.WarmLps().run(lp, **run)
    x_off, _, status_off, obj_off, bound_off = highs.WarmLps().run(lp, **run, presolve=False)
    assert status == status_off == "Optimal"
    assert obj_off == pytest.approx(optimum, rel=1e-6) and bound_off <= obj_off + 1e-9
    assert set(np.flatnonzero(x_off > 0.5)) == set(np.flatnonzero(x > 0.5))  # one choice
