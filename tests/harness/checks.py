"""Shared checks of the llama3 pipeline launches: the cases' common size, a case of that size
(:func:`llama3_case`), one step's results against the single-process reference
(:func:`check_step`) and several AdamW steps against reference AdamW
(:func:`check_tracks_adamw_reference`)."""

from __future__ import annotations

import pytest
import torch

from tests.harness.case import Case
from tests.harness.models import llama3_meta, make_batch
from tests.harness.parity import assert_all_parity, assert_norm_parity
from tests.harness.reference import reference_run
from tests.harness.workers.pipeline import CLIP_NORM

N_LAYERS = 6
BATCH, SEQ = 8, 16
ATOL = 1e-5


def check_step(results_per_rank, configs, reference):
    """One launch's results (each rank's, one entry per case) against the single-process
    reference: loss within ATOL, every gradient (full or its norm) by the parity metric, the
    clipped gradients and global norm where the case clips, the eval loss where it evaluates."""
    ref_loss, ref_grads = reference.losses[0], reference.grads
    for i, cfg in enumerate(configs):
        seen: set[str] = set()
        for rank_results in results_per_rank:
            res = rank_results[i]
            assert res["loss"] == pytest.approx(ref_loss, abs=ATOL), (cfg, res["loss"], ref_loss)
            assert_all_parity(res["grads"], ref_grads,
                              what=f"{cfg.schedule} pp={cfg.pp} grad")
            assert_norm_parity(res["grad_norms"], ref_grads,
                               what=f"{cfg.schedule} pp={cfg.pp} grad")
            seen |= set(res["grad_norms"])
            if "norm" in res:  # clipping: the global norm and the clipped gradients
                ref_norm = float(torch.linalg.vector_norm(torch.stack(  # in float64
                    [torch.linalg.vector_norm(g, dtype=torch.float64) for g in ref_grads.values()])))
                assert res["norm"] == pytest.approx(ref_norm, rel=1e-5), (cfg, res["norm"])
                coef = CLIP_NORM / (res["norm"] + 1e-6)  # torch's clip_grad_norm_ coefficient
                assert coef < 1, ref_norm  # the bound really clips
                assert_all_parity(res["clipped_grads"],  # scaled by the norm it reported
                                  {n: g * coef for n, g in res["grads"].items()},
                                  what=f"{cfg.schedule} pp={cfg.pp} clipped grad")
            if "eval_loss" in res:
                assert res["eval_loss"] == pytest.approx(ref_loss, abs=ATOL)
        assert seen == set(ref_grads), (cfg, set(ref_grads) - seen)


def llama3_case(schedule, pp, **kw) -> Case:
    """A llama3 case of the shared size, replicated stages unless ``parallelize`` says."""
    return Case(**{**dict(schedule=schedule, pp=pp, n_layers=N_LAYERS, batch=BATCH, seq=SEQ,
                          n_microbatches=4, parallelize=None), **kw})


def check_tracks_adamw_reference(results, cfg, abs_tol):
    """Every rank's per-step losses equal single-process AdamW's within ``abs_tol``; the
    state_dict round trip and eval checks of ``train_and_round_trip`` hold."""
    batches = [make_batch(BATCH, SEQ, seed=100 + k) for k in range(cfg.steps)]
    ref = reference_run(llama3_meta(cfg.n_layers), batches, lr=cfg.lr,
                        max_norm=cfg.max_norm).losses
    assert ref[-1] < ref[0]
    for r in results:
        assert r["losses"] == pytest.approx(ref, abs=abs_tol)
        assert r["same"] and r["eval_b"] == r["eval_a"] != r["eval_fresh"]
