"""The windows a schedule leaves each stage's once-per-step collectives
(autopp.schedules.comm_windows), worked out by hand for 1F1B and checked against the
simulator: a collective as long as its window costs the step nothing, a longer one costs
what exceeds it."""

from __future__ import annotations

import pytest

from autopp.schedules import StageCost, simulate_schedule
from autopp.schedules.comm_windows import collective_windows

F = I = W = 1.0  # B = 2


def _sim(schedule: str, pp: int, n_stages: int, m: int = 8, **once):
    costs = [StageCost(forward_s=F, backward_input_s=I, backward_weight_s=W,
                       collectives_ahead=True) for _ in range(n_stages)]
    for s, kw in once.items():
        costs[int(s[1:])] = StageCost(forward_s=F, backward_input_s=I, backward_weight_s=W,
                                      collectives_ahead=True, **kw)
    return simulate_schedule(schedule, costs, pp=pp, n_microbatches=m, n_stages=n_stages)


def test_1f1b_windows_by_hand():
    # rank r waits r forwards for its first input; after its last backward the ranks
    # before it still run r backwards (2 s each) until rank 0's ends the step
    sim = _sim("1F1B", 4, 4)
    assert sim.step_time_s == 33.0  # (m + p - 1) × (F + B)
    assert collective_windows(sim) == [(0.0, 0.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]


@pytest.mark.parametrize("kind, window", [("unshard_s", 3.0), ("reduce_grad_s", 6.0)])
def test_a_collective_that_fits_its_window_costs_the_step_nothing(kind, window):
    base = _sim("1F1B", 4, 4).step_time_s
    assert _sim("1F1B", 4, 4, s3={kind: window}).step_time_s == base
    # half a second over: the last rank's first forward (or the step's end) moves by it
    assert _sim("1F1B", 4, 4, s3={kind: window + 0.5}).step_time_s == pytest.approx(base + 0.5)
    # the first stage has no window: all of it shows
    assert _sim("1F1B", 4, 4, s0={kind: 0.5}).step_time_s == pytest.approx(base + 0.5)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "DualPipeV", "ZBVZeroBubble"])
def test_stages_of_a_rank_share_its_window_and_fit_together(schedule):
    """Two stages a rank: each gets half the rank's shortest window, so both collectives
    at their share leave the step as it was (they run one after the other)."""
    sim = _sim(schedule, 2, 4)
    windows = collective_windows(sim)
    ranks = sim.actions.stage_to_rank
    for r in (0, 1):
        mine = [s for s in range(4) if ranks[s] == r]
        assert windows[mine[0]] == windows[mine[1]]
    full = {f"s{s}": dict(unshard_s=w[0], reduce_grad_s=w[1]) for s, w in enumerate(windows)}
    assert _sim(schedule, 2, 4, **full).step_time_s == pytest.approx(sim.step_time_s)
    assert any(u > 0 for u, _ in windows)  # something was hidden
