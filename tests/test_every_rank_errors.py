"""Errors that end a job are raised on every rank with the same message, before any
collective they would break (3 gloo processes): a layout the world cannot hold, and a
checkpoint whose only save was interrupted."""

from __future__ import annotations

import pytest

from tests.dist_harness import run_on_ranks
from tests.fault_workers import bad_inputs


@pytest.mark.multiprocess
def test_bad_world_size_and_interrupted_checkpoint_on_every_rank(tmp_path):
    results = run_on_ranks(bad_inputs, 3, str(tmp_path), timeout=300)
    assert len({r["mesh"] for r in results}) == 1, results
    assert "pp=2 × dp=2 × tp=1 needs 4 ranks, got 3" in results[0]["mesh"]
    assert len({r["load"] for r in results}) == 1, results
    assert results[0]["load"].endswith("ckpt: its save was interrupted before it completed "
                                       "(ckpt.v1 incomplete), and no complete checkpoint is "
                                       "beside it"), results[0]
