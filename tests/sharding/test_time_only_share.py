"""Time-only solves shared across memory accountings (autopp.sharding.ilp.solver.Model.solve).

A solve with neither a memory price nor a budget never reads the memory row, so stages that
hold the same unit and differ only in their microbatches in flight (the activation factor)
share it: solved once, re-counted under each stage's row. These tests count the solver's
runs to show the sharing, check the shared result against a fresh solve, and show that every
input the LP depends on (another boundary pair, recomputation policy, largest-tensor bound,
a price or a budget) makes a solve of its own.
"""

from __future__ import annotations

import pytest
import torch

from autopp.sharding.ilp import highs
from autopp.sharding.ilp.memory_row import MemorySpec


@pytest.fixture
def runs(monkeypatch):
    """The number of HiGHS runs made so far (WarmLps.run calls). A warm re-solve is not cut
    short by time here (``highs.WARM_GUARD`` lifted to the solve's own limit): a cut warm
    start re-solves cold, which may land a degenerate LP on another (fractional) vertex and
    add a MIP run, so under load the counts would depend on the machine's speed."""
    monkeypatch.setattr(highs, "WARM_GUARD", (float("inf"), float("inf")))
    count = [0]
    real = highs.WarmLps.run

    def counted(self, *a, **k):
        count[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(highs.WarmLps, "run", counted)
    return count


@pytest.fixture(scope="module")
def unit(llama_debug, make_mesh):
    from autopp.sharding.chain.blocks import block_restrictions, boundary_candidates, trace_block
    from autopp.sharding.cost.model import CostModel
    from autopp.sharding.ilp.solver import Model
    from autopp.profiles.lookup import get_profile

    mesh = make_mesh(2, 2)
    traced = trace_block(llama_debug.layers["0"], torch.empty(8, 64, 256, device="meta"), mesh)
    base = Model(traced.strategies, CostModel(get_profile("H100"), (2, 2)),
                 memory=MemorySpec(activation_factor=1.0, optimizer_state_factor=2.0))
    cands = boundary_candidates(traced, ("dp", "tp"))
    return base, [block_restrictions(traced, a, b) for a in cands for b in cands]


def _spec(f: float, **kw) -> MemorySpec:
    return MemorySpec(activation_factor=f, optimizer_state_factor=2.0, **kw)


def test_stages_differing_in_microbatches_in_flight_share_the_time_only_solve(unit, runs):
    base, pairs = unit
    base._time_only.clear()
    four, two = base.with_memory(_spec(4.0)), base.with_memory(_spec(2.0))
    first = four.solve(*pairs[0])
    assert runs[0] == 1
    shared = two.solve(*pairs[0])
    assert runs[0] == 1, "the second stage's time-only solve ran the solver again"
    # the same plan at the same time, its memory counted under the second stage's row
    assert shared.choice == first.choice and shared.objective_s == first.objective_s
    acc = two.account(shared.choice)
    assert shared.memory_bytes == acc.counted_bytes
    assert shared.ilp_memory_bytes == pytest.approx(shared.memory_bytes, rel=1e-6)
    assert first.memory_bytes - shared.memory_bytes == pytest.approx(
        2.0 * first.activation_bytes, rel=1e-9)
    # and it is what a solve of its own gives (the same LP)
    base._time_only.clear()
    fresh = two.solve(*pairs[0])
    assert runs[0] == 2
    assert fresh.objective_s == pytest.approx(shared.objective_s, rel=1e-9)
    assert fresh.memory_bytes == pytest.approx(shared.memory_bytes, rel=1e-9) or (
        fresh.choice != shared.choice)  # an equally fast plan of another size: a tie
    for f in ("state_bytes", "activation_bytes", "gathered_bytes", "recompute_s"):
        if fresh.choice == shared.choice:
            assert getattr(fresh, f) == getattr(shared, f), f


def test_what_the_time_only_lp_depends_on_makes_a_solve_of_its_own(unit, runs):
    """Each solve is served (no solver run) or makes exactly one run of its own."""
    base, pairs = unit
    base._time_only.clear()

    def ran(solve) -> int:
        before = runs[0]
        solve()
        return runs[0] - before

    m = base.with_memory(_spec(3.0))
    assert 1 == ran(lambda: m.solve(*pairs[0]))
    assert 0 == ran(lambda: m.solve(*pairs[0]))
    assert 1 == ran(lambda: m.solve(*pairs[-1]))  # another boundary pair: other column bounds
    # another policy: other columns and times
    assert 1 == ran(lambda: m.solve(*pairs[0], recompute="full"))
    # priced: reads the row, never shared
    assert 1 == ran(lambda: m.solve(*pairs[0], price=1e-10))
    assert 1 == ran(lambda: m.solve(*pairs[0], price=1e-10))
    # under a budget: reads the row, never shared
    assert 1 == ran(lambda: m.solve(*pairs[0], budget=1e30))
    # a largest-tensor bound that excludes columns changes the LP
    some = float(sorted(set(m.column_bytes().tolist()))[-2])
    capped = base.with_memory(_spec(3.0, largest_tensor_bytes=some))
    assert 1 == ran(lambda: capped.solve(*pairs[0]))
    # another accounting of the state (no activations counted): other columns
    legacy = base.with_memory(MemorySpec())
    assert 1 == ran(lambda: legacy.solve(*pairs[0]))
    # another model (another cost model) keeps its own
    from autopp.sharding.cost.model import CostModel
    from autopp.sharding.ilp.solver import Model
    from autopp.profiles.lookup import get_profile

    other = Model(base.st, CostModel(get_profile("A100"), (2, 2)), memory=_spec(3.0))
    assert 1 == ran(lambda: other.solve(*pairs[0]))
    # and the time-only solves made above are still served, each under its own key
    assert 0 == ran(lambda: m.solve(*pairs[-1]))
    assert 0 == ran(lambda: m.solve(*pairs[0], recompute="full"))


def test_plan_stage_shares_the_unbudgeted_solves_between_in_flight_counts(stack_of, make_mesh,
                                                                          runs):
    """Two plan_stage calls on one stage of identical blocks, differing only in the
    microbatches in flight: the second solves nothing (its plan is the first's, its memory
    its own); a third with another input shape solves again."""
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request

    stage, mesh = stack_of(2), make_mesh(2, 2)
    kw = dict(optimizer_state_factor=2.0, recompute="none")
    x = torch.empty(4, 64, 256, device="meta")
    three = plan_stage(stage_request(stage, (x,), mesh, activation_factor=3.0, **kw))
    before = runs[0]
    one = plan_stage(stage_request(stage, (x,), mesh, activation_factor=1.0, **kw))
    assert runs[0] == before
    assert one.step_time_s == three.step_time_s and one.params == three.params
    assert three.memory_bytes - one.memory_bytes == pytest.approx(
        2.0 * one.activation_bytes, rel=1e-9)
    plan_stage(stage_request(stage, (torch.empty(4, 32, 256, device="meta"),), mesh,
                             activation_factor=1.0, **kw))
    assert runs[0] > before
