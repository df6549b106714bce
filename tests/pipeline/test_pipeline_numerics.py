"""After one step, the pipelined loss and every gradient equal the single-process model's
(fp32, 1e-5) for every schedule and layout. Each test is one multi-process launch."""

from __future__ import annotations

import pytest

from tests.harness.case import vary
from tests.harness.checks import (
    BATCH,
    N_LAYERS,
    SEQ,
    check_step,
    check_tracks_adamw_reference,
    llama3_case,
)
from tests.harness.launch import run_on_ranks
from tests.harness.models import llama3_meta, make_batch
from tests.harness.reference import reference_run
from tests.harness.workers.pipeline import run_configs, tp_fsdp_parallelize

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reference():
    tokens, target = make_batch(BATCH, SEQ)
    return reference_run(llama3_meta(N_LAYERS), [(tokens, target)])


def test_all_schedules_pp2(reference):
    configs = [llama3_case(s, 2, eval=True) for s in SCHEDULES]
    check_step(run_on_ranks(run_configs, 2, configs), configs, reference)


def test_all_schedules_pp4_and_pp2_dp2(reference):
    configs = [llama3_case(s, 4, n_microbatches=8) for s in [*SCHEDULES, "LoopedBFS"]]
    configs.append(llama3_case("1F1B", 2, dp=2))
    configs.append(llama3_case("Interleaved1F1B", 2, dp=2, n_microbatches=2, clip=True))
    check_step(run_on_ranks(run_configs, 4, configs), configs, reference)


def test_pp2_dp2_tp2_replicated_and_manual(reference):
    configs = [
        llama3_case("1F1B", 2, dp=2, tp=2),
        # its parameters live on two meshes (TP + FSDP on the MLPs, FSDP alone elsewhere):
        # the global norm is taken over both
        llama3_case("1F1B", 2, dp=2, tp=2, parallelize=tp_fsdp_parallelize, clip=True),
    ]
    check_step(run_on_ranks(run_configs, 8, configs), configs, reference)


def test_adamw_steps_track_reference_and_state_dict_round_trip():
    from tests.harness.workers.pipeline import train_and_round_trip

    cfg = llama3_case("Interleaved1F1B", 2, dp=2, n_microbatches=2, steps=4, lr=1e-3, max_norm=0.5)
    results = run_on_ranks(train_and_round_trip, 4, cfg)

    check_tracks_adamw_reference(results, cfg, abs_tol=5e-5)
    for r in results:
        assert r["strict_error"] and "not_a_module.weight" in r["strict_error"]


def test_checkpoint_resumes_in_another_layout(tmp_path):
    from tests.harness.workers.pipeline import checkpoint_resume

    cfg = llama3_case("Interleaved1F1B", 2, dp=2, n_microbatches=2, lr=1e-3)
    cfg = vary(cfg, resume=vary(cfg, schedule="1F1B", pp=4, dp=1, n_microbatches=4))
    results = run_on_ranks(checkpoint_resume, 4, cfg, str(tmp_path / "ckpt"))
    for r in results:
        assert set(r["resumed"]) == {2, 3}
        for step, loss in r["resumed"].items():
            assert loss == pytest.approx(r["straight"][step], abs=1e-5), (step, r)
