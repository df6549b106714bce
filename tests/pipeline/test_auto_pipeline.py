"""parallelize="auto": every stage planned over its own sub-mesh, run under torch's schedules.

After one step the loss and every gradient equal the single-process model's (fp32, 1e-5); 20
AdamW steps track the single-process loss curve; a checkpoint saved mid-run continues with
the same losses in a fresh run. Plans are cached in a temporary directory for the session,
so each distinct stage is solved once per host."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.parity import assert_w_after_i
from tests.harness.case import vary
from tests.harness.launch import run_on_ranks
from tests.harness.models import llama3_meta, make_batch
from tests.harness.reference import reference_run
from tests.harness.workers.pipeline import checkpoint_resume, run_configs, train_and_round_trip
from tests.harness.checks import BATCH, SEQ, check_step, check_tracks_adamw_reference, llama3_case
from tests.harness.checks import N_LAYERS as REPLICATED_LAYERS

pytestmark = pytest.mark.multiprocess

#: Blocks of the planned test model: every planned stage is lowered on each of its ranks,
#: and lowering costs per block, so these tests use the fewest blocks their layouts need (a
#: V schedule at pp=2 runs 4 stages: 4 blocks give each a block of its own).
N_LAYERS = 4


def _cfg(schedule, pp, **kw):
    return llama3_case(schedule, pp, **{"n_layers": N_LAYERS, **kw})

@pytest.fixture(scope="module")
def reference():
    tokens, target = make_batch(BATCH, SEQ)
    return reference_run(llama3_meta(N_LAYERS), [(tokens, target)])


GOLDEN_CSV = str(Path(__file__).parents[1] / "golden" / "interleaved1f1b_pp2_spr2_mb4.csv")
ALL_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                 "ZBVZeroBubble", "DualPipeV", GOLDEN_CSV]


def test_auto_schedules_and_layouts_match_single_process(reference):
    # planned stages are graph stages on torch's action runtime, for every schedule
    configs = [_cfg(s, 2, dp=2, tp=2, parallelize="auto", eval=True) for s in ALL_SCHEDULES]
    # activations sent between stages with their sequence split over tp
    configs.append(_cfg("1F1B", 2, dp=2, tp=2, parallelize="auto",
                        options=dict(boundary="batch+seq")))
    # loss parallel: the last stage's logits stay split on the vocabulary over tp
    configs.append(_cfg("1F1B", 2, dp=2, tp=2, parallelize="auto", loss_parallel=True,
                        eval=True))
    results = run_on_ranks(run_configs, 8, configs)
    check_step(results, configs, reference)
    # planned stages run their blocks' weight gradients as deferred W work: under the
    # zero-bubble schedule every rank ran some (4 microbatches x at least one block)
    zbv = next(i for i, c in enumerate(configs) if c.schedule == "ZBVZeroBubble")
    assert all(r[zbv]["deferred_w"] >= 4 for r in results), [r[zbv]["deferred_w"] for r in results]
    for rank, r in enumerate(results):  # and each W ran after its I
        assert_w_after_i(r[zbv]["action_log"], what=f"ZBV rank {rank}")
    for i, cfg in enumerate(configs):  # one UNSHARD and one REDUCE_GRAD per stage per step
        for r in results:
            acts, n_local = r[i]["actions"], len(r[i]["stage_ids"])
            assert acts["UNSHARD"] == acts["REDUCE_GRAD"] == n_local, (cfg.schedule, acts)
    said = [r[-1]["describe"] for r in results if 1 in r[-1]["stage_ids"]]
    assert said and all(
        "loss: loss parallel: logits stay split on the vocabulary over tp (no gather)" in d
        for d in said
    ), said[0]


@pytest.mark.wide
def test_auto_other_layouts_match_single_process(reference):
    """pp=4 (one block a stage), a 1 x 4 sub-mesh with clipping, and one stage holding the
    whole model planned on a 2 x 4 (dp x tp) sub-mesh."""
    configs = [_cfg("1F1B", 4, dp=2, tp=1, parallelize="auto", n_microbatches=4),
               _cfg("1F1B", 2, dp=1, tp=4, parallelize="auto", clip=True),
               _cfg("GPipe", 1, dp=2, tp=4, parallelize="auto", n_microbatches=2)]
    results = run_on_ranks(run_configs, 8, configs)
    check_step(results, configs, reference)
    for i, cfg in enumerate(configs):  # one UNSHARD and one REDUCE_GRAD per stage per step
        for r in results:
            acts, n_local = r[i]["actions"], len(r[i]["stage_ids"])
            assert acts["UNSHARD"] == acts["REDUCE_GRAD"] == n_local, (cfg.schedule, acts)


def test_auto_adamw_20_steps_track_reference():
    cfg = _cfg("1F1B", 2, dp=2, tp=2, parallelize="auto", steps=20, lr=1e-3, max_norm=0.5)
    check_tracks_adamw_reference(run_on_ranks(train_and_round_trip, 8, cfg), cfg, abs_tol=2e-4)


def test_auto_checkpoint_resume(tmp_path):
    # 6 blocks: the resumed layout's 8 stages need them
    cfg = _cfg("1F1B", 2, dp=2, tp=2, parallelize="auto", lr=1e-3, n_layers=REPLICATED_LAYERS)
    # resumed in another planned layout (other stages, other shards of every tensor)
    cfg = vary(cfg, resume=vary(cfg, schedule="Interleaved1F1B", pp=4, dp=2, tp=1,
                                n_microbatches=4))
    for r in run_on_ranks(checkpoint_resume, 8, cfg, str(tmp_path / "ckpt")):
        assert set(r["resumed"]) == {2, 3}
        for step, loss in r["resumed"].items():
            assert loss == pytest.approx(r["straight"][step], abs=1e-6), (step, r)


def test_auto_mixed_precision_bf16_compute_fp32_masters():
    """MixedPrecisionPolicy(bf16, fp32): the step follows the single-process model run with
    bf16 parameters (not the fp32 one), while masters and gradients stay fp32."""
    import torch

    tokens, target = make_batch(BATCH, SEQ)
    ref16 = reference_run(llama3_meta(N_LAYERS), [(tokens, target)], param_dtype=torch.bfloat16)
    ref32 = reference_run(llama3_meta(N_LAYERS), [(tokens, target)])
    cfg = _cfg("ZBVZeroBubble", 2, dp=2, tp=2, parallelize="auto", bf16=True)
    for (r,) in run_on_ranks(run_configs, 8, [cfg]):
        assert r["param_dtypes"] == r["grad_dtypes"] == ["torch.float32"]
        print(f"bf16 pipeline loss {r['loss']:.6f}, bf16 reference {ref16.losses[0]:.6f}, "
              f"fp32 reference {ref32.losses[0]:.6f}")
        # bf16 rounding depends on the plan's reduction order (equal-cost plans differ in
        # where activations are cast and reduced): the loss stays within bf16 noise of the
        # bf16 run; which run the step follows is told by the gradients below
        assert abs(r["loss"] - ref16.losses[0]) < 2e-3
        closer_to_bf16 = 0
        for name, g in r["grads"].items():
            rel = ((g - ref16.grads[name]).norm() / ref16.grads[name].norm()).item()
            assert rel < 0.02, (name, rel)
            rel32 = ((g - ref32.grads[name]).norm() / ref32.grads[name].norm()).item()
            closer_to_bf16 += rel < rel32
        # and the gradients, not only the loss, follow the bf16 run rather than the fp32 one
        assert closer_to_bf16 >= 0.75 * len(r["grads"]), (closer_to_bf16, len(r["grads"]))


def test_auto_parameters_gathered_once_per_step():
    """A parameter-only budget (``parameter_budget_bytes``) forces dp-sharded weights.
    Counted from the running pipeline: every parameter all-gather runs at the stage's
    UNSHARD action, once per step, none inside a microbatch's forward or backward (set on a
    Planner backend object). The loss and gradients equal the single-process model's."""
    batch, seq = 8, 128
    reference = reference_run(llama3_meta(REPLICATED_LAYERS), [make_batch(batch, seq)])
    configs = [_cfg("1F1B", 2, dp=2, tp=2, count_collectives=True, n_microbatches=2,
                    n_layers=REPLICATED_LAYERS, batch=batch, seq=seq, planner_options=dict(
                        parameter_budget_bytes=4e6, weight_gathering="once_per_step"))]
    results = run_on_ranks(run_configs, 8, configs)
    check_step(results, configs, reference)
    for (res,) in results:
        counts = res["collectives"]
        assert res["unshard_gathers"] > 0, counts  # the budget made weights dp-sharded
        assert counts["UNSHARD all_gather_into_tensor params"] == res["unshard_gathers"]
        assert not [k for k in counts if "params" in k and not k.startswith("UNSHARD")], counts
        assert res["actions"]["UNSHARD"] == 1
        assert "weights once per step" in res["describe"], res["describe"]
        assert res["gathered_bytes"] > 0


def test_auto_weights_gathered_and_gradients_reduced_per_block():
    """``weight_gathering="per_block"`` (FSDP's memory) at pp2 x dp2 x tp2 under 1F1B and
    ZBVZeroBubble (I/W split: reductions in W; also with full recomputation) and at
    pp1 x dp4 x tp2, dp-sharded weights (``parameter_budget_bytes``): loss and gradients
    equal the single-process model's.
    Counted from the running pipeline: no gather at UNSHARD, none of its reductions at
    REDUCE_GRAD; each microbatch's forward and backward gather the stage's weights (the
    backward gathers again, nothing gathered is saved), each microbatch's backward reduces
    its gradients; and the graphs that ran hold at most prefetch + 1 = 2 blocks gathered at
    a time (of 3 or more). In the same launch, ``weight_gathering="auto"`` with stages
    that hold their weights differently."""
    batch, seq, m = 8, 128, 2
    reference = reference_run(llama3_meta(REPLICATED_LAYERS), [make_batch(batch, seq)])
    opts = dict(parameter_budget_bytes=4e6, weight_gathering="per_block")
    configs = [_cfg(s, pp, dp=dp, tp=2, count_collectives=True, n_microbatches=m,
                    n_layers=REPLICATED_LAYERS, batch=batch, seq=seq,
                    planner_options=dict(opts, recompute=recompute))
               for s, pp, dp, recompute in (("1F1B", 2, 2, "none"),
                                            ("ZBVZeroBubble", 2, 2, "none"),
                                            ("GPipe", 1, 4, "none"),
                                            ("ZBVZeroBubble", 2, 2, "full"))]
    # weight_gathering="auto" under a whole-memory budget that stage 0 (the embedding's)
    # meets once per step only by recomputing: it gathers block by block, stage 1 once
    auto = _cfg("1F1B", 2, dp=4, tp=1, n_layers=6, batch=8, seq=16, n_microbatches=2,
                planner_options=dict(memory_budget_bytes=4.575e7, weight_gathering="auto",
                                     profile="CPU"))
    results = run_on_ranks(run_configs, 8, configs + [auto])
    check_step([r[:-1] for r in results], configs, reference)
    check_step([r[-1:] for r in results], [auto],
           reference_run(llama3_meta(6), [make_batch(auto.batch, auto.seq)]))
    for r in results:  # what describe() says: stage 0's choice, on stage 0's ranks only
        said = r[-1]["describe"].count("weights gathered block by block")
        assert said == (0 in r[-1]["stage_ids"]), r[-1]["describe"]
    results = [r[:-1] for r in results]
    for rank, r in enumerate(results):
        for cfg, res in zip(configs, r):
            what = f"{cfg.schedule} pp{cfg.pp} rank {rank}"
            counts = res["collectives"]
            assert not [k for k in counts if k.startswith(("UNSHARD", "REDUCE_GRAD"))], \
                (what, counts)
            assert "block by block" in res["describe"], res["describe"]
            split = cfg.schedule == "ZBVZeroBubble"
            gathers = bw_gathers = reduces = 0
            for st in res["per_block"]:
                c = st["param_gathers"]
                # a stage without input gradients (the first) runs no I/W split: B
                bkind = "backward_input" if split and "backward_input" in c else "full_backward"
                fw, bw = c["forward"], c[bkind]
                if fw:  # the backward gathers what it reads again, never saved
                    assert bw >= 1, (what, c)
                gathers += fw
                bw_gathers += bw
                # every reduction of the reduce-grad graph runs, once, in the graph that
                # makes the gradients (W with the I/W split, else B)
                red = st["inlined_reductions"]
                maker = "backward_weight" if split and "backward_weight" in red else \
                    "full_backward"
                assert red[maker] == sum(st["reductions"].values()), (what, st)
                reduces += red[maker]
                assert st["in_flight"]["forward"] <= 2, (what, st)
                assert st["in_flight"][bkind] <= 2, (what, st)
                if cfg.pp == 1:  # one stage of every block: two at a time, of many
                    assert st["blocks"] >= 6 and st["in_flight"]["forward"] == 2, (what, st)
            assert gathers > 0, (what, res["per_block"])  # the budget made weights dp-sharded
            # every microbatch gathers each weight in F and again in I or B (the counter
            # also counts a few all-gathers of values sharing a parameter's storage)
            assert counts["F all_gather_into_tensor params"] >= m * gathers, (what, counts)
            assert sum(counts.get(f"{k} all_gather_into_tensor params", 0) for k in "IB") \
                >= m * bw_gathers, (what, counts, bw_gathers)
            made = sum(n for k, n in counts.items() if k.split()[0] in ("B", "W"))
            assert reduces > 0 and made >= m * reduces, (what, counts, reduces)


def test_auto_compiled_stages_match_single_process(reference):
    """compile=True: every planned stage's graphs run through Inductor (2 ranks, pp=2)."""
    configs = [_cfg("1F1B", 2, parallelize="auto", options=dict(compile=True), eval=True)]
    results = run_on_ranks(run_configs, 2, configs)
    check_step(results, configs, reference)
    for (r,) in results:  # the compiled unshard / reduce-grad callables wait in place: said
        assert "wait in place in the compiled graphs" in r["describe"], r["describe"]
