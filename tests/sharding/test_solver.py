import numpy as np
import pytest
import torch

from autopp.sharding import InfeasiblePlanError, plan_stage
from tests.harness.stage_request import stage_request

from tests.harness.fake_world import MLP


def test_mlp_gets_megatron_tp(make_mesh):
    with torch.device("meta"):
        mlp = MLP(d=1024, h=4096)  # big weights, few tokens: TP beats data parallel
    mesh = make_mesh(1, 4)
    x = torch.empty(8, 16, 1024, device="meta")
    plan = plan_stage(stage_request(mlp, (x,), mesh, profile="H100"))
    pl = {p.fqn: p.placements for p in plan.params}
    # column-parallel up, row-parallel down: no activation all-gather in between
    assert pl["up.weight"] == ("R", "S(0)")
    assert pl["down.weight"] == ("R", "S(1)")
    assert plan.fallbacks == ()
    kinds = {(c.kind, c.mesh_dim) for c in plan.collectives}
    assert kinds == {("all_reduce", "tp")}  # forward output and backward input grad


def test_memory_budget_forces_fsdp(mlp_meta, make_mesh):
    mesh = make_mesh(4, 1)
    x = torch.empty(8, 1024, 512, device="meta")
    free = plan_stage(stage_request(mlp_meta, (x,), mesh))
    assert all(p.placements[0] == "R" for p in free.params)  # DDP: cheapest without budget
    full = sum(p.local_bytes for p in free.params)
    tight = plan_stage(stage_request(mlp_meta, (x,), mesh, memory_budget_bytes=full / 4))
    assert tight.param_bytes_per_device <= full / 4
    assert all(p.placements[0].startswith("S") for p in tight.params)  # FSDP-like
    assert tight.step_time_s >= free.step_time_s


def test_infeasible_memory_budget_is_named(mlp_meta, make_mesh):
    """The error names the option that set the bound: a budget with microbatches in flight
    is ``memory_budget_bytes``; one without (parameters only) ``parameter_budget_bytes``."""
    x = torch.empty(8, 1024, 512, device="meta")
    with pytest.raises(InfeasiblePlanError, match="does not fit memory_budget_bytes=1000"):
        plan_stage(stage_request(mlp_meta, (x,), make_mesh(2, 2), memory_budget_bytes=1000,
                                 activation_factor=1.0))
    with pytest.raises(InfeasiblePlanError, match="does not fit parameter_budget_bytes=1000"):
        plan_stage(stage_request(mlp_meta, (x,), make_mesh(2, 2), memory_budget_bytes=1000))


def test_a_solve_out_of_time_says_so_not_infeasible(mlp_meta, make_mesh):
    """A solve whose time limit runs out before any plan is found is not called infeasible:
    the error names the limit and the fix (HiGHS stops before its first LP at 1e-9 s)."""
    x = torch.empty(8, 1024, 512, device="meta")
    out_of_time = r"within time_limit_s=1e-09 .*raise time_limit_s"
    with pytest.raises(InfeasiblePlanError, match=out_of_time) as e:
        plan_stage(stage_request(mlp_meta, (x,), make_mesh(2, 2), time_limit_s=1e-9))
    assert "satisfies the constraints together" not in str(e.value)
    assert plan_stage(stage_request(mlp_meta, (x,),
                                    make_mesh(2, 2))).step_time_s > 0  # it is feasible


def test_indivisible_input_constraint_is_named(mlp_meta, make_mesh):
    x = torch.empty(3, 1024, 512, device="meta")  # batch 3 on dp=2
    with pytest.raises(InfeasiblePlanError, match="input_placements"):
        plan_stage(stage_request(mlp_meta, (x,), make_mesh(2, 2)))


def test_fixed_param_placement_is_honoured(mlp_meta, make_mesh):
    x = torch.empty(8, 1024, 512, device="meta")
    plan = plan_stage(stage_request(mlp_meta, (x,), make_mesh(2, 2),
                                    param_placements={"up.weight": ("S(1)", "R")}))
    assert {p.fqn: p.placements for p in plan.params}["up.weight"] == ("S(1)", "R")


def test_ilp_objective_matches_evaluation(llama_debug, make_mesh):
    """The ILP's objective and a re-pricing of its chosen options agree (no folding bugs)."""
    from autopp.sharding.chain.blocks import block_restrictions, boundary_candidates, trace_block
    from autopp.sharding.cost.model import CostModel
    from autopp.profiles.lookup import get_profile
    from autopp.sharding.ilp.solver import Model

    mesh = make_mesh(2, 4)
    traced = trace_block(llama_debug.layers["0"], torch.empty(8, 64, 256, device="meta"), mesh)
    model = Model(traced.strategies, CostModel(get_profile("H100"), (2, 4)))
    for a in boundary_candidates(traced, ("dp", "tp")):
        res = model.solve(*block_restrictions(traced, a, a))
        assert res.ilp_objective_s == pytest.approx(res.objective_s, rel=1e-6)


def test_plans_on_a_stage_sub_mesh_of_the_world_mesh(mlp_meta, fake_world):
    from torch.distributed.device_mesh import DeviceMesh

    # the world mesh as autopp.mesh lays it out (pp outermost); a stage plans on mesh["dp", "tp"]
    world = DeviceMesh("cpu", torch.arange(8).view(2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    plan = plan_stage(stage_request(mlp_meta, (torch.empty(8, 16, 512, device="meta"),),
                                    world["dp", "tp"]))
    assert plan.mesh_dim_names == ("dp", "tp") and plan.mesh_shape == (2, 2)


def test_least_memory_breaks_ties_by_time(stack_of, make_mesh):
    """A least-memory solve (price=inf) is the fastest plan among those with its memory:
    the fastest plan the ILP finds under a budget of exactly that memory is no faster.
    With the time tie-break weighted below HiGHS's tolerances (1 byte per second of time)
    the least-memory plan of this block came back 0.02% slower than that (of two blocks:
    0.03%, after 17 s of degenerate simplex; 1 s now)."""
    import math

    from autopp.sharding.chain.blocks import block_restrictions, boundary_candidates, trace_block
    from autopp.sharding.cost.model import CostModel
    from autopp.profiles.lookup import get_profile
    from autopp.sharding.ilp.solver import Model

    mesh = make_mesh(2, 2)
    traced = trace_block(stack_of(1), torch.empty(2, 64, 256, device="meta"), mesh)
    model = Model(traced.strategies, CostModel(get_profile("H100"), (2, 2)))
    a = next(iter(boundary_candidates(traced, ("dp", "tp"))))  # (S(0), R): batch-split
    restrict = block_restrictions(traced, a, a)
    least = model.solve(*restrict, price=math.inf, budget=None)
    fastest = model.solve(*restrict, budget=least.memory_bytes)
    assert fastest.memory_bytes <= least.memory_bytes
    assert least.objective_s <= fastest.objective_s * (1 + 1e-6), (least.objective_s,
                                                                  fastest.objective_s)


def _fractional_at(model, node, first: int, second: int) -> list[bool]:
    """Make ``model``'s LP relaxations answer 0.6 / 0.4 on ``node``'s options ``first`` and
    ``second``; returns the list of HiGHS runs (True: a MIP) as they are made."""
    real, calls = model._warm.run, []

    def fractional(lp, upper, integer, as_mip, *args, **kw):
        x, dt, status, obj, bound = real(lp, upper, integer, as_mip, *args, **kw)
        calls.append(as_mip)
        if not as_mip:
            x = x.copy()
            c = model.col0[node]
            x[c:c + len(model.options[node])] = 0.0
            x[c + first], x[c + second] = 0.6, 0.4
        return x, dt, status, obj, bound

    model._warm.run = fractional
    return calls


def test_a_fractional_price_solve_is_rounded_not_branched(llama_debug, make_mesh):
    """``round_fractional=True`` (the price search's intermediate solves): where the LP
    relaxation is fractional, the result is its rounding (each node's largest option) with
    the LP's optimum as its proven bound, and no MIP runs; without it, the MIP runs. The LP
    is made fractional here by rewriting one node's columns in the relaxation's answer
    (0.6 / 0.4 over its first two options): small blocks' relaxations come out integral."""
    import math

    from autopp.sharding.chain.blocks import block_restrictions, boundary_candidates, trace_block
    from autopp.sharding.cost.model import CostModel
    from autopp.profiles.lookup import get_profile
    from autopp.sharding.ilp.memory_row import MemorySpec
    from autopp.sharding.ilp.solver import Model

    mesh = make_mesh(2, 2)
    traced = trace_block(llama_debug.layers["0"], torch.empty(8, 64, 256, device="meta"), mesh)
    model = Model(traced.strategies, CostModel(get_profile("H100"), (2, 2)),
                  memory=MemorySpec(optimizer_state_factor=2.0, activation_factor=2.0))
    a = next(iter(boundary_candidates(traced, ("dp", "tp"))))
    restrict = block_restrictions(traced, a, a)
    node = next(n for n, opts in model.options.items() if len(opts) >= 2 and n not in restrict[0])
    calls = _fractional_at(model, node, 0, 1)
    price = 1e-12
    res = model.solve(*restrict, budget=None, price=price, round_fractional=True)
    assert calls == [False] and "rounded" in res.status
    assert res.choice[node] == model.options[node][0]
    assert res.bound_s <= res.objective_s + price * res.memory_bytes
    assert math.isnan(res.ilp_memory_bytes) and math.isnan(res.ilp_value_s)
    calls.clear()
    branched = model.solve(*restrict, budget=None, price=price)
    assert calls == [False, True] and "rounded" not in branched.status


@pytest.mark.parametrize("accepted", [True, False])
def test_a_fractional_time_only_solve_fixes_the_integral_columns(llama_debug, make_mesh,
                                                                   accepted):
    """A time-only solve (no price, no budget) whose LP relaxation is fractional fixes the
    integer columns the relaxation left at 0 and solves the rest as a MIP
    (``WarmLps.fix_and_solve``); its plan is taken where it is within ``FIX_GAP`` of the
    relaxation's optimum, else the whole MIP runs. The relaxation is made fractional by
    rewriting one node's columns in its answer: 0.6 on the option the (integral) relaxation
    chose, 0.4 on another. The fixed MIP then finds the optimum, which the plain solve (an
    integral relaxation, no MIP) gives: taken. Told the relaxation's optimum is 2% lower,
    the same plan is not within ``FIX_GAP`` of it: refused, and the whole MIP gives the
    same optimum."""
    import autopp.sharding.ilp.highs as highs
    from autopp.sharding.chain.blocks import block_restrictions, boundary_candidates, trace_block
    from autopp.sharding.cost.model import CostModel
    from autopp.profiles.lookup import get_profile
    from autopp.sharding.ilp.solver import Model

    mesh = make_mesh(2, 2)
    traced = trace_block(llama_debug.layers["0"], torch.empty(8, 64, 256, device="meta"), mesh)
    model = Model(traced.strategies, CostModel(get_profile("H100"), (2, 2)))
    a = next(iter(boundary_candidates(traced, ("dp", "tp"))))
    restrict = block_restrictions(traced, a, a)
    plain = model.solve(*restrict, budget=None, time_limit_s=61.0)  # integral: no MIP
    assert "integral" in plain.status
    node = next(n for n, opts in model.options.items() if len(opts) >= 2 and n not in restrict[0])
    chosen = model.options[node].index(plain.choice[node])
    other = 1 if chosen == 0 else 0
    calls = _fractional_at(model, node, chosen, other)
    if not accepted:
        real_fix, refused = model._warm.fix_and_solve, []

        def lower_bound(lp, upper, integer, x, bound, *args, **kw):
            out = real_fix(lp, upper, integer, x, bound * 0.98, *args, **kw)
            refused.append(out is None)
            return out

        model._warm.fix_and_solve = lower_bound
    res = model.solve(*restrict, budget=None, time_limit_s=62.0)  # another key: not shared
    if accepted:
        assert calls == [False, True] and "integral columns fixed" in res.status
        assert res.bound_s <= res.objective_s * (1 + 1e-9)
    else:
        assert refused == [True] and 0.02 > 10 * highs.FIX_GAP
        assert calls == [False, True, True] and "fixed" not in res.status
    assert res.objective_s == pytest.approx(plain.objective_s, rel=1e-9)
    assert res.choice[node] == plain.choice[node]


def test_a_plan_taken_from_a_fixed_relaxation_says_so(stack_of, make_mesh, monkeypatch):
    """A stage whose time-only relaxations come back fractional (rewritten here: one chosen
    option at 0.6, the next column at 0.4) is planned from the fixed relaxation, and its
    plan's notes, which ``describe()`` shows, say so: within ``FIX_GAP``, not proven
    optimal."""
    import autopp.sharding.ilp.highs as highs
    from autopp.sharding import planner
    from autopp.sharding.plan import NEAR_OPTIMAL

    real = highs.WarmLps.run

    def fractional(self, lp, upper, integer, as_mip, *args, **kw):
        x, dt, status, obj, bound = real(self, lp, upper, integer, as_mip, *args, **kw)
        if not as_mip and x.size:
            ints = np.flatnonzero(np.asarray(integer, dtype=bool)[:-1] & (x[:-1] > 0.5))
            if ints.size:
                x = x.copy()
                x[ints[0]], x[ints[0] + 1] = 0.6, 0.4
        return x, dt, status, obj, bound

    monkeypatch.setattr(highs.WarmLps, "run", fractional)
    monkeypatch.setattr(planner, "_MEMO", planner._Memo())  # nothing shared: solved here
    plan = plan_stage(stage_request(stack_of(1), (torch.empty(2, 64, 256, device="meta"),),
                                    make_mesh(2, 2)))
    notes = [n for n in plan.notes if n.startswith(NEAR_OPTIMAL)]
    assert notes and f"{highs.FIX_GAP:g} of its LP relaxation" in notes[0], plan.notes
    assert notes[0] in str(plan)
