"""The schedule simulator (autopp.schedules.simulate) against closed forms worked out by hand.

Every expected value below is a formula from the papers (or a critical path summed by hand),
never the simulator's own arithmetic. Notation: p pipeline ranks, m microbatches, v stages
per rank; F, I, W the times of one stage's forward, backward-for-inputs and
backward-for-weights on one microbatch (B = I + W for a full backward). For v > 1 these are
times of one stage (a chunk), i.e. the whole model's per-rank time divided by v.
"""

from __future__ import annotations

import json
import time

import pytest

from autopp.schedules import (
    Link,
    StageCost,
    actions_from_order,
    schedule_actions,
    simulate,
    simulate_schedule,
    write_chrome_trace,
    write_order_csv,
    write_timeline_png,
)
from autopp.schedules.build import single_stage_order

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def cost(f: float, i: float, w: float, **kw) -> StageCost:
    return StageCost(forward_s=f, backward_input_s=i, backward_weight_s=w, **kw)


def close(actual: float, expected: float, rel: float = 0.01) -> bool:
    return abs(actual - expected) <= rel * abs(expected)


# --- bubbles ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    """GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021): with
    every stage costing f forward and b backward, the step is (m + p - 1)(f + b), so the
    bubble fraction is (p - 1) / (m + p - 1) on every rank."""
    f, b = 1.0, 2.0
    result = simulate_schedule(name, cost(f, 1.5, 0.5), pp=p, n_microbatches=m)
    assert close(result.step_time_s, (m + p - 1) * (f + b), rel=1e-9)
    expected = (p - 1) / (m + p - 1)
    assert close(result.bubble_fraction, expected)
    for rank in result.ranks:
        assert close(rank.bubble_fraction, expected)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_1f1b_bubble_matches_narayanan(p, m, v):
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v chunks per rank, each costing
    f/v forward and b/v backward, shrink the bubble to (p - 1) / (v m + p - 1)."""
    f, b = 1.0, 2.0
    result = simulate_schedule("Interleaved1F1B", cost(f / v, 1.2 / v, 0.8 / v),
                               pp=p, n_microbatches=m, n_stages=v * p)
    assert close(result.bubble_fraction, (p - 1) / (v * m + p - 1))
    # the bubble time itself is (p - 1)(f + b) / v
    assert close(result.step_time_s - m * (f + b), (p - 1) * (f + b) / v)


@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1.5, 0.5)])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_zero_bubble_matches_zb_h1(f, i, w, v, p, m):
    """Zero bubble (Qi et al. 2023, section 3.1): ZB-H1 keeps 1F1B's memory and moves the
    weight gradients W into the cool-down, so its bubble is (p - 1)(F + B - W) with the
    paper's B = backward for inputs = our I; with F = I = W = t that is (p - 1) t, a third of
    1F1B's (p - 1)(F + I + W). torch's ScheduleInterleavedZeroBubble with v = 1 is ZB-H1
    ("ZB1P"); with v > 1 it is ZB-H1 on chunks of 1/v of the work, whose ramp is
    (p - 1)(F + I - W) / v. The paper's figure assumes W is not longer than F or I (a
    longer W cannot hide the cool-down), hence the cost cases. Step time:
    m (F + I + W) + (p - 1)(F + I - W) / v, with F, I, W the whole per-rank times."""
    c = cost(f / v, i / v, w / v)
    result = simulate_schedule("InterleavedZeroBubble", c, pp=p, n_microbatches=m,
                               n_stages=v * p)
    bubble = (p - 1) * (f + i - w) / v
    step = m * (f + i + w) + bubble
    assert close(result.step_time_s, step, rel=1e-9)
    assert close(result.bubble_fraction, bubble / step)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    """Qi et al. 2023, figure 3: at F = I = W, ZB-H1's bubble time is 1/3 of 1F1B's."""
    m = 4 * p
    c = cost(1.0, 1.0, 1.0)
    work = 3.0 * m
    zb = simulate_schedule("InterleavedZeroBubble", c, pp=p, n_microbatches=m, n_stages=p)
    one_f_one_b = simulate_schedule("1F1B", c, pp=p, n_microbatches=m)
    assert close(zb.step_time_s - work, (one_f_one_b.step_time_s - work) / 3, rel=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_of_p", [lambda p: 2 * p - 1, lambda p: 2 * p, lambda p: 4 * p])
def test_zbv_has_no_bubble_inside_any_rank_at_equal_times(p, m_of_p):
    """ZB-V (Qi et al. 2023, section 6): with F = I = W = t per chunk and two chunks per rank
    in a V, no rank ever waits between its first and last action ("zero bubble": the paper
    counts idle time inside each rank's span, as consecutive steps overlap). What remains in
    one step is the unavoidable ramp: the last rank starts after p - 1 forwards, so
    step = (p - 1) t + 2 m (F + I + W) = (6 m + p - 1) t, bubble (p - 1) / (6 m + p - 1).
    torch's ScheduleZBVZeroBubble warms up with 2 p - 1 microbatches, so this holds for
    m >= 2 p - 1 (below that torch's schedule does leave gaps; see the next test)."""
    m = m_of_p(p)
    t = 1.0
    result = simulate_schedule("ZBVZeroBubble", cost(t, t, t), pp=p, n_microbatches=m)
    for rank in result.ranks:
        assert rank.idle_in_span_s == pytest.approx(0.0, abs=1e-9)
    assert close(result.step_time_s, (6 * m + p - 1) * t, rel=1e-9)
    assert close(result.bubble_fraction, (p - 1) / (6 * m + p - 1))


def test_zbv_with_too_few_microbatches_is_not_bubble_free():
    """With m = p < 2 p - 1, torch's ZBV warm-up is cut short and the first rank waits."""
    p = 4
    result = simulate_schedule("ZBVZeroBubble", cost(1.0, 1.0, 1.0), pp=p, n_microbatches=p)
    assert result.ranks[0].idle_in_span_s > 0


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [2, 4])
def test_dualpipev_bubble_matches_deepseek_formula(p, m_per_p):
    """DualPipe (DeepSeek-V3 report, table 2; DualPipeV is its 'cut-in-half' V on p ranks,
    i.e. DualPipe with PP = 2p): bubble (PP/2 - 1)(F&B + B - 3W) = (p - 1)(F&B + B - 3W),
    with B a full backward chunk and F&B one overlapped forward + backward pair. torch's
    runtime (and autopp's) runs the two halves of an OVERLAP_F_B one after the other, so
    F&B = F + B. With F = I = W = t: B = 2t, F&B = 3t, bubble (p - 1)(3 + 2 - 3) t = 2 (p - 1) t
    on top of each rank's 2 m (F + I + W) = 6 m t of work."""
    m = m_per_p * p
    t = 1.0
    result = simulate_schedule("DualPipeV", cost(t, t, t), pp=p, n_microbatches=m)
    f_and_b, b, w = t + 2 * t, 2 * t, t
    assert close(result.step_time_s, 6 * m * t + (p - 1) * (f_and_b + b - 3 * w), rel=1e-9)
    for rank in result.ranks:  # work is conserved: overlapped halves are summed, not hidden
        assert rank.busy_s == pytest.approx(6 * m * t)
    assert any(e.overlapped for e in result.events)


# --- microbatches in flight and memory ----------------------------------------------------


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_in_flight_is_min_m_p_minus_stage(p, m):
    """1F1B: stage s runs p - 1 - s warm-up forwards plus one before its first backward,
    so it holds min(m, p - s) microbatches' activations at once."""
    result = simulate_schedule("1F1B", cost(1.0, 1.0, 1.0), pp=p, n_microbatches=m)
    assert result.max_in_flight == tuple(min(m, p - s) for s in range(p))


@pytest.mark.parametrize("p,m", SIZES + [(4, 2), (8, 3)])
def test_gpipe_in_flight_is_m(p, m):
    """GPipe runs every forward before any backward: all m microbatches are held."""
    result = simulate_schedule("GPipe", cost(1.0, 1.0, 1.0), pp=p, n_microbatches=m)
    assert result.max_in_flight == (m,) * p


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_in_flight_equals_1f1b(p):
    """Qi et al. 2023: ZB-H1 keeps 1F1B's peak activation memory (p microbatches on the
    first stage); with W freeing the activations, stage s holds p - s."""
    result = simulate_schedule("InterleavedZeroBubble", cost(1.0, 1.0, 1.0), pp=p,
                               n_microbatches=2 * p, n_stages=p)
    assert result.max_in_flight == tuple(p - s for s in range(p))


@pytest.mark.parametrize("name,p,m,v", [
    ("1F1B", 4, 8, 1), ("GPipe", 4, 4, 1), ("Interleaved1F1B", 4, 8, 2),
    ("ZBVZeroBubble", 4, 8, 2), ("InterleavedZeroBubble", 2, 4, 2), ("DualPipeV", 4, 8, 2)])
def test_in_flight_from_the_order_alone_equals_the_simulated(name, p, m, v):
    """The search reads in-flight counts off the action order; the simulator, from event
    times, with unequal stage costs, agrees."""
    from autopp.schedules.in_flight import max_in_flight

    from autopp.schedules.actions import compute_order

    acts = schedule_actions(name, pp=p, n_microbatches=m, n_stages=p * v)
    costs = [cost(1.0 + 0.3 * s, 1.5 + 0.1 * s, 0.7, activation_bytes_per_microbatch=1)
             for s in range(p * v)]
    simulated = simulate(acts, costs).max_in_flight
    assert max_in_flight(acts.compute, p * v) == simulated
    # and from the compute order built without torch's lowering to comms
    compute, stage_to_rank = compute_order(name, pp=p, n_microbatches=m, n_stages=p * v)
    assert compute == acts.compute and stage_to_rank == acts.stage_to_rank
    assert max_in_flight(compute, p * v) == simulated


@pytest.mark.parametrize("name,p,m", [
    ("ZBVZeroBubble", 4, 8), ("InterleavedZeroBubble", 2, 4), ("DualPipeV", 4, 8),
    ("ZBVZeroBubble", 8, 32)])
def test_split_peaks_from_the_order_give_the_simulated_activation_peak(name, p, m):
    """The planner's split-backward row (:func:`split_in_flight`, read off the action order)
    against the simulator's event-time memory: for each stage alone holding activations A
    per microbatch from F to I and K from I to W (unequal stage times), the rank's simulated
    activation peak is the largest of a x A + b x K over the stage's pairs, for K below,
    near and far above A. 1F1B's stages have no pairs (their backwards are whole)."""
    from autopp.schedules.actions import compute_order
    from autopp.schedules.in_flight import split_in_flight

    n = 2 * p
    compute, _ = compute_order(name, pp=p, n_microbatches=m, n_stages=n)
    pairs = split_in_flight(compute, n)
    acts = schedule_actions(name, pp=p, n_microbatches=m, n_stages=n)
    for s in range(n):
        rank = acts.stage_to_rank[s]
        for a_bytes, k_bytes in ((10, 1), (10, 9), (10, 13), (2, 50)):
            costs = [cost(1.0 + 0.3 * t, 1.5 + 0.1 * t, 0.7,
                          activation_bytes_per_microbatch=a_bytes if t == s else 0,
                          activation_bytes_kept_for_w=k_bytes if t == s else 0)
                     for t in range(n)]
            peak = simulate(acts, costs).ranks[rank].peak_by_category.activations
            assert peak == max(a * a_bytes + b * k_bytes for a, b in pairs[s]), (s, pairs[s])
    compute, _ = compute_order("1F1B", pp=p, n_microbatches=m, n_stages=p)
    assert split_in_flight(compute, p) == ((),) * p


def test_memory_by_category_1f1b():
    """Each rank's peak, by hand: parameters P and optimizer O all step, gathered
    parameters U from UNSHARD to RESHARD, gradients from the first backward (4G before
    REDUCE_GRAD reduces them to G), and p - s activations A at the end of the first
    backward, when the gradients are already there."""
    p, m = 4, 8
    P, G, O, U, A = 1000, 100, 3000, 500, 10
    c = cost(1.0, 1.0, 1.0, param_bytes=P, grad_bytes=G, unreduced_grad_bytes=4 * G,
             optimizer_bytes=O, gathered_param_bytes=U, activation_bytes_per_microbatch=A)
    result = simulate_schedule("1F1B", c, pp=p, n_microbatches=m)
    for s, rank in enumerate(result.ranks):
        peak = rank.memory_at_peak
        assert (peak.parameters, peak.optimizer, peak.gathered_parameters) == (P, O, U)
        assert peak.gradients == 4 * G
        assert peak.activations == (p - s) * A
        assert rank.peak_bytes == P + O + U + 4 * G + (p - s) * A
        timeline = result.memory[s]
        assert timeline.bytes["gradients"][-1] == G  # after REDUCE_GRAD
        assert timeline.bytes["gathered_parameters"][-1] == 0  # after RESHARD
        assert timeline.bytes["activations"][-1] == 0
        assert set(timeline.bytes["parameters"]) == {P}
        assert set(timeline.bytes["optimizer"]) == {O}


def test_receive_buffers_are_one_per_microbatch_each_way_all_step():
    """torch's PipelineStage preallocates one input buffer per microbatch for every stage but
    the first (``_setup_forward_recv_info``) and one output-gradient buffer per microbatch
    for every stage but the last (``_setup_backward_recv_info``), and keeps them all step.
    1F1B, p = 2, m = 4, boundary X bytes: stage 0 holds m gradient buffers, 4X; stage 1
    m input buffers, 4X (its own p2p bytes, for a send it never makes, do not count). They
    are in the peak and constant over the step; without a boundary there are none."""
    p, m, X, A = 2, 4, 1000, 10
    c = cost(1.0, 1.0, 1.0, p2p_bytes_per_microbatch=X, activation_bytes_per_microbatch=A)
    result = simulate_schedule("1F1B", c, pp=p, n_microbatches=m)
    for s, rank in enumerate(result.ranks):
        assert rank.memory_at_peak.receive_buffers == 4 * X
        assert set(result.memory[s].bytes["receive_buffers"]) == {4 * X}
        assert rank.peak_bytes == 4 * X + (p - s) * A
    assert simulate_schedule("1F1B", cost(1.0, 1.0, 1.0), pp=p, n_microbatches=m
                             ).ranks[0].memory_at_peak.receive_buffers == 0
    # stages that differ: stage 0 sends 1000 per microbatch, stage 1 (last) 7 (ignored)
    two = simulate_schedule("1F1B", [cost(1.0, 1.0, 1.0, p2p_bytes_per_microbatch=1000),
                                     cost(1.0, 1.0, 1.0, p2p_bytes_per_microbatch=7)],
                            pp=p, n_microbatches=m)
    assert [r.memory_at_peak.receive_buffers for r in two.ranks] == [4000, 4000]


def test_buffers_and_communicators_are_held_all_step():
    """A stage's registered buffers (buffer_bytes) on its rank, and each rank's
    communicator allowance, both constant over the step and in the peak: 1F1B p = 2, two
    stages with 300 and 500 bytes of buffers, 64 bytes of communicators per rank."""
    costs = [cost(1.0, 1.0, 1.0, buffer_bytes=300), cost(1.0, 1.0, 1.0, buffer_bytes=500)]
    result = simulate_schedule("1F1B", costs, pp=2, n_microbatches=2, communicator_bytes=64)
    assert [r.memory_at_peak.buffers for r in result.ranks] == [300, 500]
    assert [r.memory_at_peak.communicators for r in result.ranks] == [64, 64]
    assert [r.peak_bytes for r in result.ranks] == [364, 564]
    assert set(result.memory[1].bytes["communicators"]) == {64}


def test_communicator_bytes_count_each_group_a_rank_uses():
    """The allowance counts every mesh dim of size > 1 once: pp=2 x dp=1 x tp=4 uses two
    groups (pp, tp), pp=4 x dp=2 x tp=8 three; the H200 profile's allowance is NCCL's
    4 MiB x 2 peers x 8 channels = 64 MiB per group, the CPU profile's 0."""
    from autopp.profiles import get_profile
    from autopp.schedules.memory_terms import communicator_bytes

    assert communicator_bytes(10, (2, 1, 4)) == 20
    assert communicator_bytes(10, (4, 2, 8)) == 30
    assert communicator_bytes(10, (1, 1, 1)) == 0
    assert get_profile("H200").communicator_bytes == 64 * 2**20
    assert get_profile("CPU").communicator_bytes == 0


def test_workspace_is_held_during_its_action_only():
    """1F1B, p = 2, m = 2, A = 100 bytes of activations, F's working memory 7 and B's 11.
    Rank 0 runs F0 F1 B0 B1: during B0 it holds 2A + 11 = 211. Rank 1 runs F0 B0 F1 B1:
    during each B it holds A + 11 = 111. Between actions there is no working memory."""
    c = cost(1.0, 1.0, 1.0, activation_bytes_per_microbatch=100, forward_workspace_bytes=7,
             backward_workspace_bytes=11)
    result = simulate_schedule("1F1B", c, pp=2, n_microbatches=2)
    assert [r.peak_bytes for r in result.ranks] == [211, 111]
    assert [r.memory_at_peak.workspace for r in result.ranks] == [11, 11]
    assert result.memory[0].bytes["workspace"][-1] == 0
    assert set(result.memory[0].bytes["workspace"]) == {0, 7, 11}


def test_split_backward_frees_at_i_what_w_does_not_need():
    """ZB-H1 with activation_bytes_kept_for_w=K: each microbatch holds A from F to I and K
    from I to W. Rank p-1 (one stage, the last) runs F0 I0 then W0 later; with K = 0 its
    activations drop to zero at every I, so at most one microbatch is held there."""
    p = 4
    c = cost(1.0, 1.0, 1.0, activation_bytes_per_microbatch=8, activation_bytes_kept_for_w=0)
    result = simulate_schedule("InterleavedZeroBubble", c, pp=p, n_microbatches=2 * p,
                               n_stages=p)
    assert result.ranks[p - 1].peak_by_category.activations == 8
    kept = simulate_schedule("InterleavedZeroBubble", cost(
        1.0, 1.0, 1.0, activation_bytes_per_microbatch=8), pp=p, n_microbatches=2 * p,
        n_stages=p)
    assert kept.ranks[0].peak_by_category.activations == p * 8


# --- communication ------------------------------------------------------------------------


def test_1f1b_link_latency_adds_two_hops_on_the_critical_path():
    """1F1B, p = 2, m = 2. Rank 0 runs F0 F1 B0 B1, rank 1 runs F0 B0 F1 B1. The critical
    path is rank 0's F0, the hop to rank 1 (L), rank 1's F0 B0 F1 B1 (its F1 arrived at
    2f + L, before B0 ends at 2f + L + b), the hop back (L), and rank 0's B1:
    f + L + 2f + 2b + L + b = 3f + 3b + 2L. With n bytes on a link of bandwidth BW each
    hop is L + n / BW."""
    f, b, L = 1.0, 2.0, 0.25
    c = cost(f, 1.5, 0.5)
    base = simulate_schedule("1F1B", c, pp=2, n_microbatches=2)
    assert base.step_time_s == pytest.approx(3 * f + 3 * b)
    slow = simulate_schedule("1F1B", c, pp=2, n_microbatches=2, link=Link(latency_s=L))
    assert slow.step_time_s == pytest.approx(3 * f + 3 * b + 2 * L)
    n, bw = 1000, 4000.0
    sized = simulate_schedule("1F1B", cost(f, 1.5, 0.5, p2p_bytes_per_microbatch=n), pp=2,
                              n_microbatches=2, link=Link(latency_s=L, bandwidth_bytes_per_s=bw))
    assert sized.step_time_s == pytest.approx(3 * f + 3 * b + 2 * (L + n / bw))


def test_sends_follow_the_stage_placement():
    """torch sends across ranks only: m sends per forward boundary between ranks. In the V
    placement stages p-1 and p share the last rank, so there are 2p - 2 boundaries."""
    p, m = 4, 8
    v_actions = schedule_actions("ZBVZeroBubble", pp=p, n_microbatches=m)
    sends = sum("SEND_F" in a for row in v_actions.lowered for a in row)
    assert sends == m * (2 * p - 2)
    loop = schedule_actions("Interleaved1F1B", pp=p, n_microbatches=m)
    sends = sum("SEND_F" in a for row in loop.lowered for a in row)
    assert sends == m * (2 * p - 1)
    assert all(row[0].endswith("UNSHARD") for row in loop.lowered)
    assert sum(a.endswith("REDUCE_GRAD") for row in loop.lowered for a in row) == 2 * p


# --- inputs: CSV, orders, errors ----------------------------------------------------------


def test_csv_schedule_and_order_simulate_like_the_name(tmp_path):
    p, m = 4, 8
    path = tmp_path / "one_f_one_b.csv"
    write_order_csv(single_stage_order("Schedule1F1B", p, m), path)
    c = cost(1.0, 1.0, 1.0)
    by_name = simulate_schedule("1F1B", c, pp=p, n_microbatches=m)
    by_csv = simulate_schedule(str(path), c)
    by_order = simulate(actions_from_order(single_stage_order("Schedule1F1B", p, m)), c)
    assert by_csv.step_time_s == by_name.step_time_s == by_order.step_time_s
    assert by_csv.actions.lowered == by_name.actions.lowered


def test_errors_name_the_problem_and_the_fix():
    c = cost(1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="valid names are GPipe, 1F1B, Interleaved1F1B"):
        simulate_schedule("1F2B", c, pp=2, n_microbatches=4)
    with pytest.raises(ValueError, match="not a multiple of 2; use n_microbatches=8 or 10"):
        simulate_schedule("Interleaved1F1B", c, pp=4, n_microbatches=9)
    with pytest.raises(ValueError, match="needs pp= .* and n_microbatches="):
        simulate_schedule("1F1B", c, pp=2)
    with pytest.raises(ValueError, match="one per stage; got 3 items"):
        simulate_schedule("1F1B", [c] * 3, pp=2, n_microbatches=2)
    with pytest.raises(ValueError, match="forward_s=-1.0: must be a finite number >= 0"):
        cost(-1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        Link(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="not a valid schedule|backward"):
        actions_from_order({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]})


# --- export and speed ---------------------------------------------------------------------


def test_chrome_trace_and_png(tmp_path):
    p, m = 4, 8
    result = simulate_schedule("DualPipeV", cost(1e-3, 1e-3, 1e-3, unshard_s=2e-4,
                                                 activation_bytes_per_microbatch=2**20,
                                                 p2p_bytes_per_microbatch=2**16),
                               pp=p, n_microbatches=m, link=Link(1e-5, 1e9))
    trace = json.loads(write_chrome_trace(result, tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    processes = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(e["pid"] for e in processes) == list(range(p))
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(result.events)
    assert {e["pid"] for e in complete} == set(range(p))
    computes = sum(1 for e in complete if e["cat"] in ("F", "B", "I", "W"))
    assert computes == 3 * 2 * m * p - sum(  # F, I, W per chunk, minus merged B = I + W
        1 for e in result.events if e.kind == "B")
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == sum(len(t.times_s) for t in result.memory)
    png = write_timeline_png(result, tmp_path / "timeline.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_simulating_p8_m32_v2_is_fast():
    c = cost(1.0, 1.0, 1.0, activation_bytes_per_microbatch=1)
    start = time.perf_counter()
    result = simulate_schedule("Interleaved1F1B", c, pp=8, n_microbatches=32, n_stages=16)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed
    assert close(result.bubble_fraction, 7 / (2 * 32 + 7))


# --- the pp link between each pair of ranks -----------------------------------------------


def test_pp_link_by_whether_the_two_ranks_share_a_node():
    """(pp, dp, tp) = (4, 1, 4) on H100 nodes of 8: pp ranks 0 and 1 fill node 0, 2 and 3
    node 1, so 0 -> 1 and 2 -> 3 go over NVLink (5 us, 450 GB/s) and 1 -> 2 across nodes
    (20 us, 50 GB/s). 1 MB takes 5 us + 1e6 / 450e9 s, or 20 us + 1e6 / 50e9 s."""
    from autopp.plan.objective import pp_link, transfer_s

    shape = (4, 1, 4)
    intra, inter = 5e-6 + 1e6 / 450e9, 20e-6 + 1e6 / 50e9
    for src, dst, t in ((0, 1, intra), (1, 0, intra), (2, 3, intra), (1, 2, inter),
                        (3, 0, inter)):
        assert transfer_s(pp_link("H100", shape, src, dst), 1e6) == pytest.approx(t), (src, dst)
    # a pp rank that fills a node: every send crosses nodes
    for src in range(3):
        assert transfer_s(pp_link("H100", (4, 2, 4), src), 1e6) == pytest.approx(inter)
    # all in one node
    assert transfer_s(pp_link("H100", (2, 2, 2)), 1e6) == pytest.approx(intra)


def test_pp_ranks_share_a_node_as_their_devices_do():
    """The closed form equals the definition: every device r of pp rank a and its
    counterpart r + (b - a)·dp·tp in pp rank b are on one node."""
    from autopp.plan.objective import pp_ranks_share_node

    for pp, group, per_node in ((4, 2, 8), (4, 3, 8), (8, 1, 4), (3, 5, 8), (6, 4, 16)):
        for a in range(pp):
            for b in range(pp):
                if a != b:
                    each = all((a * group + j) // per_node == (b * group + j) // per_node
                               for j in range(group))
                    assert pp_ranks_share_node((pp, group, 1), per_node, a, b) == each


def test_a_measured_p2p_link_overrides_the_node_rule():
    from autopp.plan.objective import pp_links
    from autopp.profiles.devices import PROFILES, with_overrides

    measured = with_overrides(PROFILES["H100"], name="p2p-box", p2p_bw=7e9, p2p_latency=3e-6)
    links = pp_links(measured, (4, 1, 4))
    assert set(links) == {(a, b) for a in range(4) for b in range(4) if a != b}
    assert set(links.values()) == {Link(latency_s=3e-6, bandwidth_bytes_per_s=7e9)}


@pytest.mark.parametrize("schedule,wrap", [("Interleaved1F1B", (3, 0)),
                                           ("ZBVZeroBubble", None)])
def test_simulated_sends_go_over_the_link_between_the_ranks_they_join(schedule, wrap):
    """(4, 1, 4) on H100: a loop schedule's wrap-around send (stage 3 on rank 3 -> stage 4
    on rank 0) crosses nodes, like 1 -> 2; 0 -> 1 and 2 -> 3 stay in a node. A V's turn
    (stages 3 and 4 on rank 3) sends nothing. Each first send of a boundary finds its link
    free: it takes latency + bytes / bandwidth."""
    from autopp.estimate.pipeline import simulate_stages
    from autopp.schedules.actions import schedule_actions as actions_of

    nbytes = 4_000_000
    c = cost(1e-3, 1e-3, 1e-3, p2p_bytes_per_microbatch=nbytes)
    ranks = actions_of(schedule, pp=4, n_microbatches=8).stage_to_rank
    sim = simulate_stages(schedule, [c] * 8, pp=4, n_microbatches=8, stage_ranks=ranks,
                          profile="H100", mesh_shape=(4, 1, 4))
    intra, inter = 5e-6 + nbytes / 450e9, 20e-6 + nbytes / 50e9
    first: dict[tuple[int, int], float] = {}
    for e in sim.events:
        if e.kind == "SEND_F" and e.microbatch == 0:
            first.setdefault((e.rank, e.peer_rank), e.end_s - e.start_s)
    for (src, dst), t in first.items():
        crosses = src // 2 != dst // 2
        assert t == pytest.approx(inter if crosses else intra), (src, dst)
    if wrap is not None:
        assert wrap in first
    else:
        assert all(a != b for a, b in first)
        assert (3, 3) not in first and len(first) == 6


def test_collectives_issued_ahead_run_under_the_other_stages_compute():
    """Interleaved1F1B pp2 m2 (each rank: both UNSHARDs, its stages' compute, a REDUCE_GRAD
    after each stage's last B), F = 1, I = W = 1, instant links; worked by hand.

    UNSHARD 0.5 each. Blocking: rank 0 runs U0 [0, .5], U2 [.5, 1], then 0F0 [1, 2] ... the
    last B ends at 16. Ahead (the graph runtime's default): both gathers run on the
    communication stream, U0 [0, .5] and U2 [.5, 1]; 0F0 waits for U0 only ([.5, 1.5])
    and 2F0 (at 2.5) finds U2 done: every later action moves 0.5 earlier, so the step is
    15.5: U2 is hidden, U0 (which the first F needs) is not. The gathered weights are held
    from each UNSHARD's start either way.

    REDUCE_GRAD 0.5 each instead. Blocking: rank 1 runs 3B1 [7, 9], 3REDUCE_GRAD [9, 9.5],
    1B0 [9.5, 11.5]; rank 0's 0B1 ends at 15.5 and its 0REDUCE_GRAD at 16. Ahead:
    3REDUCE_GRAD [9, 9.5] runs under 1B0 [9, 11], rank 0's B's move 0.5 earlier, and its
    last REDUCE_GRAD [15, 15.5] still ends the step: 15.5."""
    actions = schedule_actions("Interleaved1F1B", pp=2, n_microbatches=2)
    runs = {}
    for ahead in (False, True):
        for what in ("unshard_s", "reduce_grad_s"):
            c = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1,
                          collectives_ahead=ahead, gathered_param_bytes=100, **{what: 0.5})
            runs[ahead, what] = simulate(actions, [c] * 4)
    assert runs[False, "unshard_s"].step_time_s == pytest.approx(16.0)
    assert runs[True, "unshard_s"].step_time_s == pytest.approx(15.5)
    ev = {e.action: e for e in runs[True, "unshard_s"].events if e.rank == 0}
    assert (ev["0UNSHARD"].start_s, ev["0UNSHARD"].end_s) == pytest.approx((0.0, 0.5))
    assert (ev["2UNSHARD"].start_s, ev["2UNSHARD"].end_s) == pytest.approx((0.5, 1.0))
    assert ev["0F0"].start_s == pytest.approx(0.5) and ev["2F0"].start_s == pytest.approx(2.5)
    for ahead in (False, True):  # both stages' gathered copies from t = 0 on
        assert runs[ahead, "unshard_s"].ranks[0].peak_by_category.gathered_parameters == 200
    assert runs[False, "reduce_grad_s"].step_time_s == pytest.approx(16.0)
    assert runs[True, "reduce_grad_s"].step_time_s == pytest.approx(15.5)
    ev = {e.action: e for e in runs[True, "reduce_grad_s"].events if e.rank == 1}
    assert (ev["3REDUCE_GRAD"].start_s, ev["3REDUCE_GRAD"].end_s) == pytest.approx((9, 9.5))
    assert ev["1B0"].start_s == pytest.approx(9.0)
