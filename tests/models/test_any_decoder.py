"""Any decoder whose blocks repeat takes the planner's block-reuse path, and parameters tied
across stages train as one: torchtitan's qwen3 (tied input embedding and output head, on
different pp ranks) and a Hugging Face style nested decoder (blocks at ``model.layers``, the
RoPE table handed to every layer) match the single-process model at pp2 × dp2 × tp2 (fp32,
1e-5) over two AdamW steps with clipping, as llama3 does; the planner plans all three block
by block (never one flat graph)."""

from __future__ import annotations

import pytest
import torch

from tests.harness.parity import assert_all_parity, assert_norm_parity
from tests.harness.case import Case, vary
from tests.harness.launch import run_on_ranks
from tests.harness.workers.decoder import mismatched_tied_parallelize, run
from tests.harness.models import MODELS, make_batch
from tests.harness.reference import Reference, reference_run

N_LAYERS, BATCH, SEQ, LR, MAX_NORM = 4, 8, 16, 1e-2, 0.5


def _reference(kind: str) -> Reference:
    """Single-process plain torch: a step with clipping, then the loss after it."""
    batch = make_batch(BATCH, SEQ)
    return reference_run(MODELS[kind](N_LAYERS), [batch, batch], lr=LR, max_norm=MAX_NORM)


def _decoders() -> dict[str, Case]:
    return {kind: Case(model=kind, pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
                       n_layers=N_LAYERS, batch=BATCH, seq=SEQ, lr=LR, max_norm=MAX_NORM,
                       checkpoint=kind == "qwen3")
            for kind in ("qwen3", "hf", "llama3")}


@pytest.mark.multiprocess
def test_tied_qwen3_and_nested_decoder_match_single_process(tmp_path):
    qwen3 = _decoders()["qwen3"]
    configs = [qwen3, _decoders()["hf"],
               # V placement: the embedding's and the head's stages on one rank (a mirror
               # copy); its checkpoint loads into the loop placement, and the loop's back into V
               vary(qwen3, schedule="ZBVZeroBubble", n_microbatches=4, cross="1F1B"),
               # a user parallelize placing the two copies differently: refused on every rank
               vary(qwen3, checkpoint=False, expect_error=True,
                    parallelize=mismatched_tied_parallelize)]
    results = run_on_ranks(run, 8, configs, str(tmp_path), timeout=900)
    errors = {r[-1]["error"] for r in results}
    assert len(errors) == 1 and "must be placed alike on every rank" in errors.pop(), errors
    assert "tok_embeddings.weight: (Shard(dim=0),) on ranks" in results[0][-1]["error"]
    configs, results = configs[:-1], [r[:-1] for r in results]
    _check_decoders(configs, results)
    # tied: the head's copy is named (and checkpointed) as the embedding, once; both copies
    # keep one value after the optimizer step
    last = next(r[0] for r in results if "norm.weight" in r[0]["state_keys"])
    first = next(r[0] for r in results if "norm.weight" not in r[0]["state_keys"])
    assert "tok_embeddings.weight" in last["state_keys"]
    assert "lm_head.weight" not in last["state_keys"]
    torch.testing.assert_close(last["values"]["tok_embeddings.weight"],
                               first["values"]["tok_embeddings.weight"], atol=0, rtol=0)
    # the checkpoint stores the tied parameter once, under its first name, and restores both
    # copies (a fresh pipeline's eval loss becomes the trained one's)
    ck = last["checkpoint"]
    assert "model.tok_embeddings.weight" in ck["keys"]
    assert not [k for k in ck["keys"] if "lm_head" in k]
    assert ck["eval_loaded"] == pytest.approx(ck["eval"], abs=1e-6) != ck["eval_fresh"]


@pytest.mark.multiprocess
@pytest.mark.wide
def test_llama3_and_unplanned_tied_copies_match_single_process(tmp_path):
    """llama3 on the same path (also in tests/pipeline/test_auto_pipeline.py), and qwen3's tied
    copies without the planner (replicated stages, plain tensors)."""
    configs = [_decoders()["llama3"], vary(_decoders()["qwen3"], checkpoint=False,
                                           parallelize=None)]
    _check_decoders(configs, run_on_ranks(run, 8, configs, str(tmp_path), timeout=900))


def _check_decoders(configs: list[Case], results: list[list[dict]]) -> None:
    """Every configuration's losses, gradients and state keys against its single-process
    reference; a V configuration's tied key once per rank and its checkpoints across
    placements."""
    vs = [i for i, cfg in enumerate(configs) if cfg.schedule == "ZBVZeroBubble"]
    for v in (r[i] for r in results for i in vs):  # V: one key for the tied parameter
        # on the rank holding both copies
        assert "lm_head.weight" not in v["state_keys"], v["state_keys"]
        for key in ("keys", "cross_keys"):
            if v["checkpoint"]:
                assert not [k for k in v["checkpoint"][key] if "lm_head" in k], v["checkpoint"]
        if v["checkpoint"]:
            ck = v["checkpoint"]
            assert ck["eval_cross"] == pytest.approx(ck["eval"], abs=1e-6) != ck["eval_fresh"]
            assert ck["eval_back"] == pytest.approx(ck["eval"], abs=1e-6)
    for i, cfg in enumerate(configs):
        ref = _reference(cfg.model)
        seen = set()
        for rank_results in results:
            res = rank_results[i]
            assert res["losses"] == pytest.approx(ref.losses, abs=1e-5), cfg.model
            assert res["norm"] == pytest.approx(ref.norm, rel=1e-5), cfg
            assert_all_parity(res["grads"], ref.grads, what=f"{cfg.model} grad")
            assert_norm_parity(res["grad_norms"], ref.grads, what=f"{cfg.model} grad")
            seen |= set(res["grad_norms"])
            # the block-reuse path: units are the part before the blocks, each block, the
            # part after, never one flat graph
            per_rank = 2 if cfg.schedule == "ZBVZeroBubble" else 1
            assert len(res["units"]) == (0 if cfg.parallelize != "auto" else per_rank)
            # the model's own state-dict hooks hold for planned stages too: torchtitan's
            # fused QKV is saved as wq/wk/wv, as single-process torchtitan saves it
            assert not [k for k in res["state_keys"] if "wqkv" in k], cfg
            if cfg.model != "hf":
                assert [k for k in res["state_keys"] if k.endswith(".wq.weight")], cfg
            for sid, units in res["units"].items():
                if not any(".layers." in f".{f}" for f in res["stage_fqns"][sid]):
                    assert units == [""], units  # no block (V: the head alone): one unit
                    continue
                assert "" not in units and any(".layers." in f".{u}" for u in units), units
                assert units[0] == "pre" if sid == 0 else \
                    units[-1] == "post" if sid == 2 * per_rank - 1 else True
        names = {n for n, _ in MODELS[cfg.model](N_LAYERS).named_parameters()}
        assert seen == names, (cfg.model, names ^ seen)
