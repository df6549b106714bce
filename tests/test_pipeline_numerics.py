"""After one step, the pipelined loss and every gradient equal the single-process model's
(fp32, 1e-5) for every schedule and layout. Each test is one multi-process launch."""

from __future__ import annotations

import pytest
import torch

from tests.parity import assert_all_parity, assert_norm_parity
from tests.dist_harness import run_on_ranks
from tests.case import Case, vary
from tests.models import llama3_meta, make_batch
from tests.reference import reference_run
from tests.pipeline_workers import CLIP_NORM, run_configs, tp_fsdp_parallelize

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
N_LAYERS = 6
BATCH, SEQ = 8, 16
ATOL = 1e-5

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reference():
    tokens, target = make_batch(BATCH, SEQ)
    return reference_run(llama3_meta(N_LAYERS), [(tokens, target)])


def _check(results_per_rank, configs, reference):
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


def _cfg(schedule, pp, **kw) -> Case:
    """A llama3 case of this module's size, replicated stages unless ``parallelize`` says."""
    return Case(**{**dict(schedule=schedule, pp=pp, n_layers=N_LAYERS, batch=BATCH, seq=SEQ,
                          n_microbatches=4, parallelize=None), **kw})


def _check_tracks_adamw_reference(results, cfg, abs_tol):
    """Every rank's per-step losses equal single-process AdamW's within ``abs_tol``; the
    state_dict round trip and eval checks of ``train_and_round_trip`` hold."""
    batches = [make_batch(BATCH, SEQ, seed=100 + k) for k in range(cfg.steps)]
    ref = reference_run(llama3_meta(cfg.n_layers), batches, lr=cfg.lr,
                        max_norm=cfg.max_norm).losses
    assert ref[-1] < ref[0]
    for r in results:
        assert r["losses"] == pytest.approx(ref, abs=abs_tol)
        assert r["same"] and r["eval_b"] == r["eval_a"] != r["eval_fresh"]


def test_all_schedules_pp2(reference):
    configs = [_cfg(s, 2, eval=True) for s in SCHEDULES]
    _check(run_on_ranks(run_configs, 2, configs), configs, reference)


def test_all_schedules_pp4_and_pp2_dp2(reference):
    configs = [_cfg(s, 4, n_microbatches=8) for s in [*SCHEDULES, "LoopedBFS"]]
    configs.append(_cfg("1F1B", 2, dp=2))
    configs.append(_cfg("Interleaved1F1B", 2, dp=2, n_microbatches=2, clip=True))
    _check(run_on_ranks(run_configs, 4, configs), configs, reference)


def test_pp2_dp2_tp2_replicated_and_manual(reference):
    configs = [
        _cfg("1F1B", 2, dp=2, tp=2),
        # its parameters live on two meshes (TP + FSDP on the MLPs, FSDP alone elsewhere):
        # the global norm is taken over both
        _cfg("1F1B", 2, dp=2, tp=2, parallelize=tp_fsdp_parallelize, clip=True),
    ]
    _check(run_on_ranks(run_configs, 8, configs), configs, reference)


def test_adamw_steps_track_reference_and_state_dict_round_trip():
    from tests.pipeline_workers import train_and_round_trip

    cfg = _cfg("Interleaved1F1B", 2, dp=2, n_microbatches=2, steps=4, lr=1e-3, max_norm=0.5)
    results = run_on_ranks(train_and_round_trip, 4, cfg)

    _check_tracks_adamw_reference(results, cfg, abs_tol=5e-5)
    for r in results:
        assert r["strict_error"] and "not_a_module.weight" in r["strict_error"]


def test_checkpoint_resumes_in_another_layout(tmp_path):
    from tests.pipeline_workers import checkpoint_resume

    cfg = _cfg("Interleaved1F1B", 2, dp=2, n_microbatches=2, lr=1e-3)
    cfg = vary(cfg, resume=vary(cfg, schedule="1F1B", pp=4, dp=1, n_microbatches=4))
    results = run_on_ranks(checkpoint_resume, 4, cfg, str(tmp_path / "ckpt"))
    for r in results:
        assert set(r["resumed"]) == {2, 3}
        for step, loss in r["resumed"].items():
            assert loss == pytest.approx(r["straight"][step], abs=1e-5), (step, r)
