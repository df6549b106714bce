"""The budget search's mix and polish across boundary pairs (autopp.sharding.chain.budget): a
stage of identical blocks whose plans differ by the placement each block receives and
sends (its boundary pair). The exact optimum under the budget is found by enumerating every
chain of placements and every plan at every position; the search's chain must fit, lie at
or above it, and in all but a few cases equal it, with its bound below it."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from autopp.sharding.chain import budget as B
from autopp.sharding import plan_stage
from tests.harness.stage_request import stage_request
from autopp.sharding.ilp.memory_row import MemorySpec
from autopp.sharding.ilp.solution import InfeasiblePlanError, SolveResult
from autopp.tracing.units import Unit

PAIRS = [("a", "a"), ("a", "b"), ("b", "a"), ("b", "b")]
MEMORY = MemorySpec(1.0, None, 1.0)


def _result(t: float, m: float, bound: float) -> SolveResult:
    return SolveResult(choice={}, objective_s=t, compute_s=t, comm_s=0.0, collectives=(),
                       param_bytes=m, num_vars=1, num_binary=1, num_rows=1, solve_s=0.0,
                       status="listed", memory_bytes=m, bound_s=bound)


class _PairedModel:
    """A block whose plans are a list of (time, bytes) per boundary pair, solved exactly by
    enumeration; records the pairs solved with the budget in the row."""

    def __init__(self, plans: dict[tuple, list[tuple[float, float]]]):
        self.plans = plans
        self.budget_solves: list[tuple] = []

    def solve(self, restrict, names, *, time_limit_s, recompute, budget, price, start,
              rel_gap, max_nodes=None, round_fractional=False, objective_target_s=None):
        pair = restrict["pair"]
        plans = [(t, m) for t, m in self.plans[pair] if budget is None or m <= budget]
        if budget is not None:
            self.budget_solves.append(pair)
        if not plans:
            raise InfeasiblePlanError("no listed plan fits")
        if math.isinf(price):
            t, m = min(plans, key=lambda p: (p[1], p[0]))
            return _result(t, m, float("nan"))
        t, m = min(plans, key=lambda p: p[0] + price * p[1])
        return _result(t, m, t + price * m)  # exact: the bound is the optimum


def _stage(model: _PairedModel, n: int) -> B.Stage:
    rep = B.DistinctUnit(Unit("block", nn.Identity()), None, model, ("listed", 0),
                         {p: ({"pair": p}, {}) for p in model.plans}, ())
    return B.Stage([rep.unit] * n, [0] * n, [rep], ["a"], ["a"], [], False, {})


def _exact(model: _PairedModel, n: int, budget: float) -> float:
    """The fastest chain a -> ... -> a under ``budget``, every placement chain and plan."""
    best = math.inf
    for mid in itertools.product("ab", repeat=n - 1):
        at = ["a", *mid, "a"]
        pairs = [(at[i], at[i + 1]) for i in range(n)]
        for combo in itertools.product(*(model.plans[p] for p in pairs)):
            if sum(m for _, m in combo) <= budget:
                best = min(best, sum(t for t, _ in combo))
    return best


# A case where mixing only on the boundary pairs of the best chain a price gives
# (a -> b -> b -> a here) reaches 3.072; the optimum, 2.995, takes other pairs.
CASE = {("a", "a"): [(0.96, 11.89), (1.051, 8.14), (1.182, 4.71)],
        ("a", "b"): [(0.879, 11.77), (1.034, 8.57), (1.261, 5.88)],
        ("b", "a"): [(0.857, 10.51), (1.011, 7.82), (1.506, 4.29)],
        ("b", "b"): [(0.991, 9.53), (1.104, 6.94), (1.378, 4.36)]}


def test_the_mix_takes_other_boundary_pairs_than_the_best_priced_chain():
    model = _PairedModel(CASE)
    chosen, _, bound = B.choose_chain(_stage(model, 3), ["none"], 26.5, MEMORY, 60.0)
    exact = _exact(model, 3, 26.5)
    assert exact == pytest.approx(2.995)
    assert chosen.memory_bytes <= 26.5
    assert chosen.time_s == pytest.approx(exact, rel=1e-12)
    assert bound <= exact + 1e-12
    # the pairs chain: each block receives what the one before it sends
    assert chosen.pairs[0][0] == "a" and chosen.pairs[-1][1] == "a"
    assert all(p[1] == q[0] for p, q in zip(chosen.pairs, chosen.pairs[1:]))


def _convex(rng: random.Random) -> list[tuple[float, float]]:
    """Three plans on a convex front: each step to fewer bytes costs more time a byte."""
    t, m, slope, out = rng.uniform(0.8, 1.0), rng.uniform(9, 12), rng.uniform(0.02, 0.06), []
    for _ in range(3):
        out.append((round(t, 3), round(m, 2)))
        dm = rng.uniform(2, 4)
        t, m, slope = t + slope * dm, m - dm, slope * rng.uniform(1.5, 3)
    return out


def test_random_chains_of_blocks_reach_the_enumerated_optimum():
    """120 seeded cases of 3 blocks, 4 boundary pairs and a random budget: the chain always
    fits, its bound is below the optimum, and it is the optimum in at least 90% of cases.
    Measured: 113 of 120 (the rest at most 4.9% slower); the search before this mix (on the
    best priced chain's pairs only, and no polish of a block whose positions use different
    pairs, e0e5faf) 94 of 120, up to 11.0% slower (printed with ``-s``)."""
    rng = random.Random(7)
    cases = exact_hits = 0
    worst = 0.0
    for _ in range(120):
        model = _PairedModel({p: _convex(rng) for p in PAIRS})
        least = min(m for _, m in model.plans["a", "a"]) * 3
        budget = round(rng.uniform(least, 2.2 * least), 1)
        exact = _exact(model, 3, budget)
        chosen, _, bound = B.choose_chain(_stage(model, 3), ["none"], budget, MEMORY, 60.0)
        cases += 1
        assert chosen.memory_bytes <= budget + 1e-12
        assert bound <= exact + 1e-12 <= chosen.time_s + 2e-12, (model.plans, budget)
        exact_hits += chosen.time_s <= exact * (1 + 1e-12)
        worst = max(worst, chosen.time_s / exact - 1)
    print(f"the optimum in {exact_hits} of {cases} cases, the worst {worst:.1%} slower")
    assert exact_hits >= 0.9 * cases, (exact_hits, cases, worst)


def test_positions_of_one_block_on_different_pairs_are_polished():
    """Two positions of one block, a -> b and b -> a, the searched chain 10% over its
    bound: each position is solved again under what the other leaves it (the polish used
    to skip a unit whose positions did not share one pair)."""
    model = _PairedModel({("a", "a"): [(1.0, 6.0)], ("b", "b"): [(1.0, 6.0)],
                          ("a", "b"): [(1.0, 6.0), (0.8, 7.0)],
                          ("b", "a"): [(1.0, 6.0), (0.85, 7.0)]})
    stage = _stage(model, 2)
    searched = B.Chain("none", [_result(1.0, 6.0, 1.0)] * 2, [("a", "b"), ("b", "a")],
                       2.0, 12.0, ilp_bound_s=1.65, bound_s=1.65)
    chosen = B._polish(stage, "none", 14.0, searched, 60.0, {})
    assert sorted(model.budget_solves) == [("a", "b"), ("b", "a")]
    assert chosen.time_s == pytest.approx(1.65) and chosen.memory_bytes <= 14.0


@pytest.mark.wide  # ~45 s on 2 cores: the whole-stage MIP solved to 1e-7
def test_a_real_stage_matches_the_whole_stage_mip(stack_of, make_mesh, monkeypatch):
    """2 llama3 debugmodel blocks, dp=2 x tp=2, AdamW state, 2 microbatches in flight,
    gradients reduced once over 8, at 60% of the fastest plan's memory: the composed plan
    (units solved on their own, chained and mixed) is within 1% of the whole stage's ILP
    (one flat MIP with the budget in its row, solved to 1e-7), which the planner's bound
    does not exceed."""
    stage, mesh = stack_of(2), make_mesh(2, 2)
    x = torch.empty(4, 64, 256, device="meta")
    kw = dict(activation_factor=2.0, optimizer_state_factor=2.0, recompute="none",
              microbatches_per_grad_reduce=8)
    budget = 0.6 * plan_stage(stage_request(stage, (x,), mesh, **kw)).memory_bytes
    composed = plan_stage(stage_request(stage, (x,), mesh, memory_budget_bytes=budget, **kw))
    for name, value in (("CERTIFIED_GAP", -1.0), ("_POLISH_GAP", 1e-7),
                        ("POLISH_TARGET", False), ("POLISH_NODES", 10**7),
                        ("POLISH_TIME_S", 600.0)):
        monkeypatch.setattr(B, name, value)
    exact = plan_stage(stage_request(stage, (x,), mesh, memory_budget_bytes=budget,
                                     reuse_blocks=False, time_limit_s=600.0, **kw))
    assert composed.memory_bytes <= budget and exact.memory_bytes <= budget
    assert composed.step_time_s <= exact.step_time_s * 1.01, (composed.step_time_s,
                                                              exact.step_time_s)
    assert composed.time_bound_s <= exact.step_time_s * (1 + 1e-9)
