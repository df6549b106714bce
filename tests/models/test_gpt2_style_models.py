"""Forwards that read their input's shape, split into pipeline stages.

GPT-2's forward takes the batch, the sequence length and the positions from ``input_ids``;
run on a received activation as its input, a later stage's forward fails (or hands its
blocks other arguments). Such a model's stages run the forward on the model's own inputs,
given to every stage as keyword inputs (:mod:`autopp.stage_split.model_inputs`). Checked here
with plain torch (a stage's output equals the whole model's), on transformers' GPT-2 and
GPTBigCode on meta, and trained at pp2 × dp2 × tp2 on 8 gloo processes against transformers'
own single-process model (its "sdpa" attention, plain AdamW), fp32 within the suite's bounds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness.case import Case
from tests.harness.launch import run_on_ranks
from tests.harness.models import MODELS, make_batch
from tests.harness.parity import assert_all_parity, assert_norm_parity
from tests.harness.reference import reference_run

N_LAYERS, BATCH, SEQ, LR, MAX_NORM = 4, 8, 16, 1e-2, 0.5
#: Per model, a parameter budget (bytes a device) under which the planner splits the
#: blocks' weights over tp: at these tiny sizes it keeps them replicated otherwise. A stage
#: holds 0.8e6 to 0.95e6 bytes of parameters: sharded over dp alone about half, over dp and
#: tp about a quarter; the budget leaves too little for the blocks sharded over dp alone.
PARAMETER_BUDGET = {"hf_gpt2": 2.8e5, "hf_gpt_bigcode": 2.8e5, "reads_input": 2.4e5}


def test_stages_run_on_the_models_inputs():
    """Split in three, the plain-torch model's stages, each called as the pipeline calls it
    (a later stage: the received activation, the model's inputs as keywords), compute the
    whole model's output exactly. Called on the activation alone (the default for forwards
    that do not read their input) the middle stage fails: the check says it reads them."""
    from autopp.stage_split import (
        build_stage_module, model_input_keywords, stages_read_model_inputs)

    split = [["wte", "wpe", "h.0"], ["h.1", "h.2"], ["h.3", "head"]]
    meta = MODELS["reads_input"](N_LAYERS)
    tokens = torch.randint(0, 2048, (3, SEQ))
    assert stages_read_model_inputs([build_stage_module(meta, f) for f in split], (tokens,))
    torch.manual_seed(0)
    model = type(meta)(N_LAYERS)
    stages = [build_stage_module(model, f) for f in split]
    given = model_input_keywords((tokens,))
    x = stages[0](tokens, **given)
    with pytest.raises(ValueError, match="too many values to unpack"):
        stages[1](x)  # the activation's shape is not the input's
    out = stages[2](stages[1](x, **given), **given)
    torch.testing.assert_close(out, model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("kind,reads", [("hf_gpt2", True), ("hf_gpt_bigcode", False),
                                        ("hf_llama", False)])
def test_which_forwards_read_their_input(kind, reads):
    """transformers' GPT-2 reads ``input_ids``' shape (``size``, ``view``), so its stages run
    on the model's inputs: on the activation alone as its input, its later stage fails (the
    refusal users saw). GPTBigCode's and Llama's forwards only hand ``input_ids`` to the
    embedding (GPTBigCode's position embedding, held by the other stage, stands in as the
    activation, so it adds up: it was refused before) and keep the default: their blocks
    get the same arguments either way."""
    from autopp import adapters, tracing
    from autopp.stage_split import (
        build_stage_module, check_stage_forwards, model_input_keywords,
        stages_read_model_inputs)
    from autopp.stage_split.model_inputs import InputReads

    model = MODELS[kind](N_LAYERS)
    adapters.prepare(model)
    stages = [build_stage_module(model, f, allow_tied=True) for f in _halves(model)]
    mb = torch.empty(2, SEQ, dtype=torch.long, device="meta")
    assert stages_read_model_inputs(stages, (mb,)) is reads
    checked = InputReads(stages, (mb,))
    check_stage_forwards(checked.calls, (mb,))
    assert checked.read is reads

    calls = []  # the tensor arguments of the later stage's first block, by name
    block = next(iter(stages[1].get_submodule(_layers(model)).children()))
    block.register_forward_pre_hook(lambda m, a, kw: calls.append(
        {k: tuple(v.shape) for k, v in kw.items() if isinstance(v, torch.Tensor)}),
        with_kwargs=True)
    x = torch.empty(2, SEQ, 64, device="meta")
    with torch.no_grad(), tracing.on_meta():
        stages[1](x, **model_input_keywords((mb,)))
        if kind == "hf_gpt2":
            with pytest.raises(RuntimeError, match=r"shape '\[-1, 16, 64, 64\]' is invalid"):
                stages[1](x)
        else:
            stages[1](x)
    if not reads:
        assert calls[0] == calls[1], calls


def test_a_module_the_forward_calls_after_the_stage_end_is_refused():
    """OPT registers its final norm before its layers: a split puts it on the first stage,
    and the forward calls it after that stage's last layer, whose output the stage sends.
    Without the check the norm's output was lost (the logits silently unnormalised); now
    the stage check refuses it by name."""
    from autopp import adapters
    from autopp.stage_split import build_stage_module, check_stage_forwards

    model = MODELS["hf_opt"](N_LAYERS)
    adapters.prepare(model)
    split = _halves(model)
    assert "model.decoder.final_layer_norm" in split[0]
    stages = [build_stage_module(model, f, allow_tied=True) for f in split]
    mb = torch.empty(2, SEQ, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"stage 0 of 2 .* calls model\.decoder\."
                                         r"final_layer_norm after model\.decoder\.layers\.1"):
        check_stage_forwards(stages, (mb,))


def _layers(model: nn.Module) -> str:
    from autopp.stage_split import find_layers

    return find_layers(model)


def _halves(model: nn.Module) -> list[list[str]]:
    from autopp.stage_split import resolve_split

    return resolve_split(model, 2)


def _check(configs: list[Case], results: list[list[dict]]) -> None:
    """Every rank's losses, gradient norm and gradients against transformers' own model;
    the stages ran on the model's inputs; planned stages took the block-reuse path and split
    blocks over tp."""
    from autopp.stage_split import find_layers

    for i, cfg in enumerate(configs):
        meta = MODELS[cfg.model](N_LAYERS)
        with torch.device("cpu"):
            if hasattr(meta, "config"):
                model = type(meta)(meta.config)
                assert model.config._attn_implementation == "sdpa"  # transformers' own
            else:
                model = type(meta)(N_LAYERS)
        layers = find_layers(meta) + "."
        batch = make_batch(BATCH, SEQ)
        ref = reference_run(model, [batch, batch], lr=LR, max_norm=MAX_NORM)
        seen = set()
        for rank_results in results:
            res = rank_results[i]
            what = f"{cfg.model} {cfg.parallelize!r} {cfg.planner_options}"
            assert res["losses"] == pytest.approx(ref.losses, abs=1e-5), what
            assert res["norm"] == pytest.approx(ref.norm, rel=1e-5), what
            assert_all_parity(res["grads"], ref.grads, what=f"{what} grad")
            assert_norm_parity(res["grad_norms"], ref.grads, what=f"{what} grad")
            seen |= set(res["grad_norms"])
            noted = any("every stage runs it on the model's inputs" in n
                        for n in res["model_notes"])
            assert noted is (cfg.model != "hf_gpt_bigcode"), res["model_notes"]
            if cfg.parallelize != "auto":
                continue
            for sid, units in res["units"].items():  # the block-reuse path
                assert "" not in units, units
                assert any(u.startswith(layers) for u in units), units
                assert units[0] == "pre" if sid == 0 else units[-1] == "post", units
            blocks = [n for n in res["tp_sharded"] if n.startswith(layers)]
            assert blocks, res["tp_sharded"]  # tensor parallelism really tested
        names = {n for n, _ in meta.named_parameters()}
        assert seen == names, (cfg.model, names ^ seen)


def _configs(models_and_backends) -> list[Case]:
    return [Case(model=model, pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
                 n_layers=N_LAYERS, batch=BATCH, seq=SEQ, lr=LR, max_norm=MAX_NORM,
                 parallelize=parallelize,
                 planner_options=({"parameter_budget_bytes": PARAMETER_BUDGET[model]}
                                  if parallelize == "auto" else None))
            for model, parallelize in models_and_backends]


@pytest.mark.multiprocess
def test_gpt2_planned_and_replicated_match_transformers():
    """GPT2LMHeadModel (Conv1D weights, learned positions, ``lm_head`` tied to ``wte`` on
    the other stage) at pp2 × dp2 × tp2, planned under a parameter budget that splits its
    blocks over tp, and replicated, in one launch."""
    from tests.harness.workers.gpt2_style import run

    configs = _configs([("hf_gpt2", "auto"), ("hf_gpt2", None)])
    _check(configs, run_on_ranks(run, 8, configs, timeout=1500))


@pytest.mark.wide
@pytest.mark.multiprocess
def test_bigcode_user_fn_and_plain_torch_match_single_process():
    """GPTBigCodeForCausalLM (multi-query attention; refused before, on the default path
    now) planned and replicated, GPT-2 through a user ``parallelize`` function (FSDP2 per
    block), and a plain-torch model whose forward reads its input and takes no other
    keyword, planned; in one launch."""
    from tests.harness.workers.gpt2_style import fsdp_blocks, run

    configs = _configs([("hf_gpt_bigcode", "auto"), ("hf_gpt_bigcode", None),
                        ("hf_gpt2", fsdp_blocks), ("reads_input", "auto")])
    _check(configs, run_on_ranks(run, 8, configs, timeout=1500))
