"""The test launcher itself: a deadlocked or crashing rank ends the launch within its
deadline, every rank is killed, and each rank's last lines are in the error."""

from __future__ import annotations

import time

import pytest

from tests.harness.workers import pipeline as pipeline_workers
from tests.harness.launch import LaunchError, run_on_ranks

pytestmark = pytest.mark.multiprocess


def test_deadlock_ends_at_the_deadline_with_every_ranks_last_lines():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        # the work's deadline counts from when both ranks joined the process group (start-up
        # takes seconds on a loaded 2-core machine, more when this launch starts the
        # forkserver): long enough for both to reach the barrier, far shorter than gloo's
        # own 30-minute timeout
        run_on_ranks(pipeline_workers.skip_a_collective, 2, timeout=120, work_timeout=8)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert took < 100, took  # the deadline plus clean-up, not gloo's 30 minutes
    assert "deadline of 8 s after every rank started passed; ranks [0, 1] still running" in msg
    assert "rank 0 (running)" in msg and "rank 1 (running)" in msg
    assert "rank 0: entering the barrier" in msg
    assert "rank 1: skipping the barrier" in msg


def test_a_rank_that_dies_without_a_result_ends_the_launch():
    with pytest.raises(LaunchError, match="rank 1 exited with code 3 without a result"):
        run_on_ranks(pipeline_workers.exit_without_result, 2, timeout=60)


def test_a_crashed_rank_is_named_before_the_peer_that_failed_because_of_it():
    """The peer's error arrives first; the launch's error still names the rank that died,
    then the peer's error (seen in a clean-clone run: "rank 0 raised" hid rank 1's exit)."""
    with pytest.raises(LaunchError) as e:
        run_on_ranks(pipeline_workers.raise_after_peer_died, 2, timeout=60)
    msg = str(e.value)
    assert "rank 1 exited with code 3 without a result; before that was seen: rank 0 " \
           "raised" in msg, msg
    assert "Connection closed by peer" in msg  # its own, or gloo's while connecting


def test_a_rank_that_segfaults_shows_where_it_died():
    """A crash in native code (seen under load: a rank exiting with -11 and no output) shows
    the rank's Python stack at the crash in the launch's error."""
    with pytest.raises(LaunchError) as e:
        run_on_ranks(pipeline_workers.segfault_in_a_function, 2, timeout=60)
    msg = str(e.value)
    assert "rank 1 exited with code -11 without a result" in msg, msg
    assert "Fatal Python error: Segmentation fault" in msg, msg
    assert "read_address_zero" in msg, msg


def test_a_native_heap_abort_fails_the_launch_once(tmp_path):
    """A rank killed by glibc's heap check is an error like any crash: the launch is not
    made again (the gloo race behind such aborts is worked around: tests/compat/test_gloo_race.py)."""
    from tests.harness.workers.gloo_race import abort_like_glibc

    marker = tmp_path / "launches"
    with pytest.raises(LaunchError, match="rank 1 exited with code -6") as e:
        run_on_ranks(abort_like_glibc, 2, str(marker), timeout=60)
    assert "unaligned tcache chunk" in str(e.value)
    assert marker.read_text() == "launched\n"


def test_parity_metric_agrees_with_hand_cases_and_assert_close():
    """The one comparator (tests/harness/parity.py): the per-tensor relative bound, the near-zero
    floor, and the elementwise bound, whose fast path must give torch's verdict."""
    import torch

    from tests.harness.parity import EPS, assert_parity

    ref = torch.tensor([1.0, -2.0, 0.5, 4.0])
    assert assert_parity(ref.clone(), ref, what="same") == 0.0
    # ‖diff‖ / ‖ref‖ = 2^-20 / sqrt(21.25) (2^-20 is exact in fp32): inside both bounds
    got = ref + torch.tensor([2.0 ** -20, 0.0, 0.0, 0.0])
    assert abs(assert_parity(got, ref, what="close") - 2.0 ** -20 / 21.25 ** 0.5) < 1e-12
    # relative 3e-5 > 1e-5 per tensor (elementwise it would pass: 1.4e-4 < 1e-5 + 1e-4 * 4)
    with pytest.raises(AssertionError, match="relative error"):
        assert_parity(ref + torch.tensor([0.0, 0.0, 0.0, 1.4e-4]), ref, what="rel")
    # a near-zero reference is held to REL * EPS absolutely
    tiny = torch.full((4,), 1e-6)
    assert_parity(tiny + 4e-9, tiny, what="tiny")  # ‖diff‖ 8e-9 <= 1e-5 * EPS
    with pytest.raises(AssertionError, match=f"eps {EPS:g}"):
        assert_parity(tiny + 1e-8, tiny, what="tiny")  # ‖diff‖ 2e-8 > 1e-8
    # elementwise: one element of a large tensor off by more than atol + rtol |r|
    big = torch.ones(100_000)
    off = big.clone()
    off[7] += 5e-3  # per tensor 5e-3 / 316 = 1.6e-5: under the rel=1e-4 given here
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 100000"):
        assert_parity(off, big, what="elementwise", rel=1e-4)
    for bad in (float("nan"), float("inf")):  # non-finite values fail, as assert_close says
        with pytest.raises(AssertionError):
            assert_parity(torch.tensor([1.0, bad]), torch.tensor([1.0, 1.0]), what="nonfinite")
    both_inf = torch.tensor([1.0, float("inf")])
    with pytest.raises(AssertionError):  # inf - inf is nan in the per-tensor norm
        assert_parity(both_inf.clone(), both_inf, what="inf")
