"""The test launcher itself: a deadlocked or crashing rank ends the launch within its
deadline, every rank is killed, and each rank's last lines are in the error."""

from __future__ import annotations

import time

import pytest

from tests import pipeline_workers
from tests.dist_harness import LaunchError, run_on_ranks

pytestmark = pytest.mark.multiprocess


def test_deadlock_ends_at_the_deadline_with_every_ranks_last_lines():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        run_on_ranks(pipeline_workers.skip_a_collective, 2, timeout=15)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert took < 60, took  # the deadline plus start-up and clean-up, not gloo's 30 minutes
    assert "deadline of 15 s passed; ranks [0, 1] still running" in msg
    assert "rank 0 (running)" in msg and "rank 1 (running)" in msg
    assert "rank 0: entering the barrier" in msg
    assert "rank 1: skipping the barrier" in msg


def test_a_rank_that_dies_without_a_result_ends_the_launch():
    with pytest.raises(LaunchError, match="rank 1 exited with code 3 without a result"):
        run_on_ranks(pipeline_workers.exit_without_result, 2, timeout=60)
