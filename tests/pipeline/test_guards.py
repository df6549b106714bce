"""Mistakes and divergence are caught with a clear error on every rank, before they turn
into a hang, a gloo abort or a damaged checkpoint (real processes: 4 gloo ranks, pp2 x dp2)."""

from __future__ import annotations

import pytest

from tests.harness.launch import run_on_ranks
from tests.harness.workers.pipeline import guards
from tests.harness.checks import llama3_case

pytestmark = pytest.mark.multiprocess


def test_guards_raise_on_every_rank(tmp_path):
    cfg = llama3_case("1F1B", 2, dp=2, n_microbatches=2, lr=1e-3)
    results = run_on_ranks(guards, 4, cfg, str(tmp_path / "ckpt"), timeout=300)
    for r in results:
        # a sequence length the pipeline was not built for: named, before any collective
        assert r["shape"].startswith("ValueError: step/eval got inputs of shapes [(4, 8)], "
                                     "but this pipeline was built for [(4, 16)]"), r["shape"]
        # a diverged model: the step's loss is NaN on every rank, and the step says so
        assert r["nan_step"].startswith("FloatingPointError: the step's loss is nan"), r
        # raise_on_nonfinite=False: the same step warns instead, on every rank
        assert r["nan_step_warned"] == "nothing raised", r
        assert any(w.startswith("the step's loss is nan") for w in r["warnings"]), r
        # and its state is not written over the last good checkpoint
        assert r["nan_save"].startswith("ValueError: refusing to save a non-finite state"), r
        assert r["restored_finite"] and r["finite"]
        assert r["restored_loss"] == pytest.approx(r["good_loss"], abs=1e-6)  # same weights
