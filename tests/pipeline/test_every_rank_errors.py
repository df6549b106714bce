"""Errors that end a job are raised on every rank with the same message, before any
collective they would break (3 gloo processes): a layout the world cannot hold, and a
checkpoint whose only save was interrupted."""

from __future__ import annotations

import pytest

from tests.harness.launch import run_on_ranks
from tests.harness.workers.fault import bad_inputs


@pytest.mark.multiprocess
def test_bad_world_size_and_interrupted_checkpoint_on_every_rank(tmp_path):
    results = run_on_ranks(bad_inputs, 3, str(tmp_path), timeout=300)
    assert len({r["mesh"] for r in results}) == 1, results
    assert "pp=2 × dp=2 × tp=1 needs 4 ranks, got 3" in results[0]["mesh"]
    assert len({r["load"] for r in results}) == 1, results
    assert results[0]["load"].endswith("ckpt: its save was interrupted before it completed "
                                       "(ckpt.v1 incomplete), and no complete checkpoint is "
                                       "beside it"), results[0]


@pytest.mark.multiprocess
def test_the_example_prints_one_line_per_rank_on_a_bad_world():
    """The example launched on 3 processes for pp2 x dp2 x tp2: each rank prints the same
    one-line error (no traceback, no gloo "connection closed" from a rank left waiting)."""
    import re
    import sys
    from pathlib import Path

    from tests.harness.launch import run_command

    root = Path(__file__).resolve().parents[2]
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "3", str(root / "examples/llama3_pp_dp_tp.py"),
                       "--pp", "2", "--dp", "2", "--tp", "2"], timeout=240, check=False)
    # torchrun stops the other ranks when the first exits, so a rank still starting may be
    # stopped before it prints: every rank that prints prints this one line
    errors = re.findall(r"\[rank (\d)\] error: (.*)", out)
    assert errors and len({r for r, _ in errors}) == len(errors), out[-3000:]
    assert {msg for _, msg in errors} == {"pp=2 × dp=2 × tp=2 needs 8 ranks, got 3; choose sizes "
                                          "whose product is the world size"}, errors
    # no traceback from the ranks (torchrun itself reports the failed children after them)
    assert 'llama3_pp_dp_tp.py", line' not in out and "ProcessGroupGloo" not in out, out[-3000:]


@pytest.mark.multiprocess
def test_ranks_waiting_for_rank0_outlast_the_default_groups_timeout():
    """While rank 0 plans (or searches), the others wait on a group of their own with a
    long timeout, not on the job's default group, whose timeout (NCCL's watchdog: 10 min,
    300 s in torchtitan) a 70B plan outlasts: here the default group times out after 3 s
    and rank 0 works 6 s."""
    from tests.harness.workers.fault import slow_rank0

    results = run_on_ranks(slow_rank0, 2, timeout=120)
    for r in results:
        assert r["value"] == {"plan": "made on rank 0"}, r
        assert r["error"].startswith("no layout of 2 devices fits"), r
    assert results[1]["waited_s"] > 5, results[1]  # it did wait past the default's 3 s
    assert "(raised on rank 0 while searching layouts; this rank waited)" in results[1]["error"]
    assert results[1]["control"].startswith("timed out after"), results[1]
