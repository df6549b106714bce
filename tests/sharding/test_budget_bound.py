"""The budget search's certified bound (autopp.sharding.chain.budget): on stages whose units have a
few hand-listed plans, the exact optimum under the budget is found by enumerating every
chain, and the search's bound must lie below it and its chosen chain within the certified
gap above it; a policy whose bound cannot beat another policy's chain is not polished."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from autopp.sharding.chain import budget as B
from autopp.sharding import plan_stage
from tests.harness.stage_request import stage_request
from autopp.sharding.ilp.memory_row import MemorySpec
from autopp.sharding.ilp.solution import InfeasiblePlanError, SolveResult
from autopp.tracing.units import Unit

PAIR = ("a", "a")


def _result(t: float, m: float, bound: float) -> SolveResult:
    return SolveResult(choice={}, objective_s=t, compute_s=t, comm_s=0.0, collectives=(),
                       param_bytes=m, num_vars=1, num_binary=1, num_rows=1, solve_s=0.0,
                       status="listed", memory_bytes=m, bound_s=bound)


class _ListedModel:
    """A unit whose plans are a list of (time, bytes) per recomputation policy: solved
    exactly by enumeration; counts the solves made with the budget in the row."""

    def __init__(self, plans: dict[str, list[tuple[float, float]]]):
        self.plans = plans
        self.budget_solves = 0
        self.targets: list[float | None] = []

    def solve(self, *restrictions, time_limit_s, recompute, budget, price, start, rel_gap,
              max_nodes=None, round_fractional=False, objective_target_s=None):
        plans = [(t, m) for t, m in self.plans[recompute] if budget is None or m <= budget]
        if budget is not None:
            self.budget_solves += 1
            self.targets.append(objective_target_s)
        if not plans:
            raise InfeasiblePlanError("no listed plan fits")
        if objective_target_s is not None and price == 0:
            # a MIP that meets its plans in list order stops at the first on target
            for t, m in plans:
                if t <= objective_target_s:
                    return _result(t, m, min(t for t, _ in plans))
        if math.isinf(price):
            t, m = min(plans, key=lambda p: (p[1], p[0]))
            return _result(t, m, float("nan"))
        t, m = min(plans, key=lambda p: p[0] + price * p[1])
        return _result(t, m, t + price * m)  # exact: the bound is the optimum


def _stage(models: list[_ListedModel], kinds: list[int]) -> B.Stage:
    reps = [B.DistinctUnit(Unit(f"u{k}", nn.Identity()), None, m, ("listed", k),
                           {PAIR: ({}, {})}, ()) for k, m in enumerate(models)]
    return B.Stage([reps[k].unit for k in kinds], kinds, reps, ["a"], ["a"], [], False, {})


def _exact(models, kinds, mode, budget) -> float:
    """The fastest chain under ``budget`` by enumerating every plan at every position."""
    best = math.inf
    for combo in itertools.product(*(models[k].plans[mode] for k in kinds)):
        if sum(m for _, m in combo) <= budget:
            best = min(best, sum(t for t, _ in combo))
    return best


# a block whose plans trade time for memory unevenly (the price's duality gap shows), and
# an end unit with two plans
BLOCK = [(1.00, 10.0), (1.08, 7.0), (1.30, 5.5), (2.00, 3.0)]
END = [(0.50, 4.0), (0.70, 1.0)]


@pytest.mark.parametrize("budget", [60.0, 45.0, 37.0, 31.0, 24.0])
def test_bound_is_below_the_exact_optimum_and_the_chain_within_the_gap(budget):
    models = [_ListedModel({"none": END}), _ListedModel({"none": BLOCK})]
    kinds = [0, 1, 1, 1, 1]
    stage = _stage(models, kinds)
    chosen, tried, bound = B.choose_chain(stage, ["none"], budget, MemorySpec(1.0, None, 1.0),
                                          60.0)
    exact = _exact(models, kinds, "none", budget)
    assert chosen.memory_bytes <= budget
    assert bound <= exact + 1e-12, (bound, exact)
    # every listed plan is met by some price here, and the mix over what the search met is
    # exact: the optimum, which at 37 mixes plans of the identical blocks (no single plan
    # for all four reaches it: 4.82)
    assert chosen.time_s == pytest.approx(exact, rel=1e-12)
    if models[1].budget_solves == 0:  # stopped by the certificate, without the polish
        assert chosen.time_s - bound <= B.CERTIFIED_GAP * chosen.time_s
    print(f"budget {budget}: chosen {chosen.time_s:.3f}, exact {exact:.3f}, bound {bound:.3f}")


@pytest.mark.parametrize("gap", [0.02, 0.1, 0.3])
def test_a_looser_optimality_gap_stops_sooner_and_stays_within_it(gap):
    """``optimality_gap`` (``Stage.gap``): at every budget the chain is within ``gap`` of the
    exact optimum, and the search makes no more solves than at the default 1%; over the
    budgets some loose gap makes fewer (else the knob would do nothing)."""
    kinds, fewer = [0, 1, 1, 1, 1], False
    for budget in (45.0, 37.0, 31.0, 24.0):
        counts, times = [], []
        for g in (None, gap):
            end, block = _ListedModel({"none": END}), _ListedModel({"none": BLOCK})
            calls = []
            for m in (end, block):
                m.solve = (lambda real: lambda *a, **k: calls.append(1) or real(*a, **k))(m.solve)
            stage = _stage([end, block], kinds)
            stage.gap = g
            chosen, _, bound = B.choose_chain(stage, ["none"], budget,
                                              MemorySpec(1.0, None, 1.0), 60.0)
            exact = _exact([end, block], kinds, "none", budget)
            assert chosen.memory_bytes <= budget
            assert bound <= exact + 1e-12 and chosen.time_s <= exact * (1 + (g or 0.01)) + 1e-12
            counts.append(len(calls))
            times.append(chosen.time_s)
        assert counts[1] <= counts[0], (budget, counts)
        fewer |= counts[1] < counts[0]
    if gap >= 0.1:
        assert fewer


def test_a_policy_that_cannot_beat_the_others_chain_is_not_polished():
    """'selective' is faster unconstrained than 'none' fits, so it is searched; its bound
    under the budget reaches 'none''s fitting time, so it is dropped before any solve with
    the budget in the row."""
    none_plans = [(1.0, 10.0), (1.1, 6.0)]
    sel_plans = [(0.9, 12.0), (1.5, 5.0), (3.0, 2.0)]
    block = _ListedModel({"none": none_plans, "selective": sel_plans})
    stage = _stage([block], [0, 0, 0])
    chosen, tried, bound = B.choose_chain(stage, ["none", "selective"], 18.0,
                                          MemorySpec(1.0, None, 1.0), 60.0)
    assert chosen.recompute == "none" and chosen.time_s == pytest.approx(3.3)
    assert [m for m, _, _ in tried] == ["none", "selective"]
    assert block.budget_solves == 0
    assert bound <= _exact([block], [0, 0, 0], "none", 18.0) + 1e-12


@pytest.mark.wide  # ~55 s on 2 cores: the search as it was polishes with slow MIPs
def test_planned_stage_matches_the_always_polished_search(stack_of, make_mesh, monkeypatch):
    """On a real stage (2 llama3 blocks, dp=2 x tp=2, AdamW state and 2 microbatches in
    flight counted) under a budget that binds, the search as it is now (stopping at the
    certificate, mixing the plans it met) is within 1% of, or faster than, the search as it
    was (every price to the tolerance, then the polish, one plan per identical block), fits
    the same budget, and reports a bound no plan beats."""
    stage = stack_of(2)
    mesh = make_mesh(2, 2)
    x = torch.empty(4, 64, 256, device="meta")
    kw = dict(activation_factor=2.0, optimizer_state_factor=2.0, recompute="auto")
    free = plan_stage(stage_request(stage, (x,), mesh, **kw))
    for frac in (0.5,):
        budget = frac * free.memory_bytes
        now = plan_stage(stage_request(stage, (x,), mesh, memory_budget_bytes=budget, **kw))
        with monkeypatch.context() as m:
            m.setattr(B, "CERTIFIED_GAP", -1.0)  # never certified: search on, then polish
            m.setattr(B, "_best_mix", lambda stage, best, seen, budget: best)
            m.setattr(plan_module_memo(), "solves", {})
            before = plan_stage(stage_request(stage, (x,), mesh, memory_budget_bytes=budget, **kw))
        assert now.memory_bytes <= budget and before.memory_bytes <= budget
        assert now.step_time_s <= before.step_time_s * 1.01, (frac, now.step_time_s,
                                                               before.step_time_s)
        assert now.time_bound_s is not None and now.time_bound_s <= before.step_time_s + 1e-12
        assert "of the certified bound" in str(now)
        print(f"budget {frac:.0%} of free: now {now.step_time_s * 1e3:.4f} ms, before "
              f"{before.step_time_s * 1e3:.4f} ms, bound {now.time_bound_s * 1e3:.4f} ms")


def plan_module_memo():
    from autopp.sharding import planner

    return planner._MEMO


def test_a_polish_starts_from_a_plan_that_fits_its_share(monkeypatch):
    """At budget 37 the fastest chain mixes plans of the four identical blocks (10, 7, 7, 7
    bytes beside the end's 4): the fastest of them (10 bytes) is over the blocks' share
    (33 / 4 = 8.25), so a polish started from it would start from no plan at all (HiGHS
    drops an infeasible start). Forced to polish, every solve with the budget in the row
    gets a start that fits the budget it is given."""
    starts: list[tuple[float | None, float]] = []

    class _Recording(_ListedModel):
        def solve(self, *restrictions, budget, price, start, **kw):
            res = super().solve(*restrictions, budget=budget, price=price, start=start, **kw)
            if budget is not None:
                starts.append((None if start is None else start["plan"][1], budget))
            return SolveResult(**{**{f: getattr(res, f) for f in res.__slots__},
                                  "choice": {"plan": (res.objective_s, res.memory_bytes)}})

    models = [_Recording({"none": END}), _Recording({"none": BLOCK})]
    stage = _stage(models, [0, 1, 1, 1, 1])
    monkeypatch.setattr(B, "CERTIFIED_GAP", -1.0)  # never certified: always polished
    chosen, _, _ = B.choose_chain(stage, ["none"], 37.0, MemorySpec(1.0, None, 1.0), 60.0)
    assert chosen.time_s == pytest.approx(_exact(models, [0, 1, 1, 1, 1], "none", 37.0))
    assert sorted(r.memory_bytes for r in chosen.results[1:]) == [7.0, 7.0, 7.0, 10.0]
    assert starts and all(m is not None and m <= share for m, share in starts), starts




@pytest.mark.parametrize("target_on", [True, False])
def test_a_polish_stops_at_the_first_plan_that_certifies_its_chain(monkeypatch, target_on):
    """An end unit and four identical blocks; the searched chain (the blocks at 2.0 s, 3
    bytes) is 31% over its bound, 6.5 s. The blocks' MIP under their share (28 / 4 bytes)
    meets its plans in list order: 1.6 s, then 1.505 s (which brings the chain within half
    the certified gap of its bound), then the optimum 1.5 s. Given the target that
    certifies the chain, it stops at 1.505 s, and the polish stops there (the end unit is
    not solved again); without a target it runs on to the optimum."""
    monkeypatch.setattr(B, "POLISH_TARGET", target_on)
    end = _ListedModel({"none": END})
    block = _ListedModel({"none": [(1.6, 7.0), (1.505, 7.0), (1.5, 7.0)]})
    stage = _stage([end, block], [0, 1, 1, 1, 1])
    results = [_result(0.5, 4.0, 0.5)] + [_result(2.0, 3.0, 2.0)] * 4
    searched = B.Chain("none", results, [PAIR] * 5, 8.5, 16.0, ilp_bound_s=6.5,
                       bound_s=6.5)
    chosen = B._polish(stage, "none", 32.0, searched, 60.0, {})
    if target_on:
        target = (6.5 / (1 - B.CERTIFIED_GAP / 2) - 0.5) / 4  # 1.5082 s a block
        assert block.targets == [pytest.approx(target)] and end.targets == []
        assert chosen.time_s == pytest.approx(0.5 + 4 * 1.505)
        assert chosen.time_s - 6.5 <= B.CERTIFIED_GAP * chosen.time_s
    else:
        assert block.targets == [None]
        assert chosen.time_s == pytest.approx(0.5 + 4 * 1.5)


def test_a_policy_its_bytes_only_relaxations_prove_over_budget_skips_its_least_memory_mips(
        stack_of, make_mesh, monkeypatch):
    """2 llama3 blocks, dp=2 x tp=2, 8 microbatches in flight, under 25 MiB: recompute
    'none' needs at least 29.1 MiB (its least-memory plan, as the over-budget error reports
    it), so 'auto' recomputes. The bytes-only LP relaxations prove 'none' over the
    budget, so its least-memory MIPs (seconds each at 70B) are not solved; the plan is the
    one the MIPs' path gives, and the reported least for 'none' is a lower bound of the
    MIPs' least-memory plan that still exceeds the budget."""
    from autopp.sharding.ilp.solver import Model

    stage, mesh = stack_of(2), make_mesh(2, 2)
    x = torch.empty(4, 64, 256, device="meta")
    kw = dict(activation_factor=8.0, optimizer_state_factor=2.0, recompute="auto",
              memory_budget_bytes=25 * 2**20)
    solves: list[tuple[str, float, bool]] = []
    real = Model.solve

    def counted(self, *a, **k):
        solves.append((k["recompute"], k["price"], k["round_fractional"]))
        return real(self, *a, **k)

    monkeypatch.setattr(Model, "solve", counted)
    monkeypatch.setattr(plan_module_memo(), "solves", {})
    now = plan_stage(stage_request(stage, (x,), mesh, **kw))
    assert not [s for s in solves if s[0] == "none" and math.isinf(s[1]) and not s[2]]
    with monkeypatch.context() as m:  # the path before: the MIPs decide
        m.setattr(B, "_least_bytes_bound", lambda *a: -math.inf)
        m.setattr(plan_module_memo(), "solves", {})
        before = plan_stage(stage_request(stage, (x,), mesh, **kw))
    assert now.recompute == before.recompute != "none"
    assert now.step_time_s == pytest.approx(before.step_time_s, rel=1e-9)
    least_now = {mode: least for mode, _, _, least in now.recompute_options}["none"]
    least_before = {mode: least for mode, _, _, least in before.recompute_options}["none"]
    assert 25 * 2**20 < least_now <= least_before * (1 + 1e-9), (least_now, least_before)
    assert "none: does not fit (needs at least" in str(now)


def test_the_over_budget_error_names_the_least_memory_plan_after_the_lp_bound(
        stack_of, make_mesh, monkeypatch):
    """Where no policy fits (1 KB), every policy is proven over the budget by its bytes-only
    relaxations, but the error still names the least-memory plan's consumers: the same
    message the least-memory MIPs' path gives."""
    stage, mesh = stack_of(2), make_mesh(2, 2)
    x = torch.empty(4, 64, 256, device="meta")
    kw = dict(activation_factor=8.0, optimizer_state_factor=2.0, recompute="auto",
              memory_budget_bytes=1000.0)
    monkeypatch.setattr(plan_module_memo(), "solves", {})
    with pytest.raises(InfeasiblePlanError) as now:
        plan_stage(stage_request(stage, (x,), mesh, **kw))
    with monkeypatch.context() as m:
        m.setattr(B, "_least_bytes_bound", lambda *a: -math.inf)
        m.setattr(plan_module_memo(), "solves", {})
        with pytest.raises(InfeasiblePlanError) as before:
            plan_stage(stage_request(stage, (x,), mesh, **kw))
    assert "least-memory plan" in str(now.value)
    assert str(now.value) == str(before.value)
