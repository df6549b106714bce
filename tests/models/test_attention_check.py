"""What autopp swaps into a transformers model's attention is checked against the model's own:
implemented variants (logit softcapping, sliding windows, per-model scaling) equal the
model's numbers, a feature autopp's op lacks runs as the model's own function (logged, in
the notes ``describe()`` shows), and a mask autopp cannot reproduce is refused by name.
References are transformers' own models run in one process (their eager attention)."""

from __future__ import annotations

import logging

import pytest
import torch

import autopp.ops.attention  # noqa: F401  (registers autopp::sdpa)
from autopp.ops import attention_blockwise
from tests.harness.attention_models import gemma2, sink_llama
from tests.harness.models import ce_loss, logits_of, make_batch
from tests.harness.parity import assert_all_parity, assert_parity

transformers = pytest.importorskip("transformers")

SEQ = 16


def _naive(q, k, v, causal, scale, mask, cap):
    """Attention with capped scores written out (a score tensor per head)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("causal,kv_heads,window", [(True, 4, None), (True, 2, 5),
                                                    (False, 2, 3)])
def test_capped_scores_match_the_written_out_math_across_blocks(monkeypatch, causal,
                                                                  kv_heads, window):
    """autopp::sdpa with ``softcap``: output and q/k/v gradients equal the written-out math,
    with several query blocks (a small block size) and grouped-query heads; the cap changes
    the result (without it the output differs by far more than the tolerance); the op and
    its backward pass opcheck."""
    from autopp.ops.attention import keep_mask

    monkeypatch.setattr(attention_blockwise, "BLOCK_BYTES", 2 * 4 * 20 * 4 * 4)
    assert attention_blockwise.block_rows(2, 4, 20, 20) < 20  # more than one block
    torch.manual_seed(0)
    q = (torch.randn(2, 4, 20, 8) * 3).requires_grad_()
    k = (torch.randn(2, kv_heads, 20, 8) * 3).requires_grad_()
    v = torch.randn(2, kv_heads, 20, 8, requires_grad=True)
    mask = keep_mask(20, 20, device=torch.device("cpu"), causal=causal, window=window)
    is_causal = causal and mask is None
    ours, lse = torch.ops.autopp.sdpa(q, k, v, is_causal, 0.35, kv_heads < 4, mask, 5.0)
    ref = _naive(q, k, v, is_causal, 0.35, mask, 5.0)
    assert_parity(ours, ref, what="capped output")
    g = torch.randn_like(ours)
    assert_all_parity(dict(zip("qkv", torch.autograd.grad(ours, (q, k, v), g))),
                      dict(zip("qkv", torch.autograd.grad(ref, (q, k, v), g))),
                      what="capped gradient")
    assert (_naive(q, k, v, is_causal, 0.35, mask, 0) - ref).abs().max() > 0.1
    args = (q.detach(), k.detach(), v.detach(), is_causal, 0.35, kv_heads < 4, mask, 5.0)
    torch.library.opcheck(torch.ops.autopp.sdpa.default, args)
    torch.library.opcheck(torch.ops.autopp.sdpa_backward.default,
                          (g, *args[:3], ours.detach(), lse, *args[3:]))


def _loss_and_grads(model):
    tokens, target = make_batch(4, SEQ)
    model.zero_grad()
    loss = ce_loss(logits_of(model(tokens)), target)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gemma2_softcap_window_and_scaling_keep_the_models_numbers():
    """Each variant changes the model's numbers (its reference with the feature switched off
    differs), and with autopp's attention swapped in the loss and every gradient equal the
    model's own (eager attention, as transformers runs Gemma2)."""
    ref_loss, ref_grads = _loss_and_grads(gemma2(device="cpu"))
    for off in ({"attn_logit_softcapping": None}, {"sliding_window": 2 * SEQ},
                {"query_pre_attn_scalar": 16}):
        assert abs(_loss_and_grads(gemma2(device="cpu", **off))[0] - ref_loss) > 1e-3, off
    from autopp import adapters

    model = gemma2(device="cpu")
    notes = adapters.prepare(model)
    assert model.config._attn_implementation == "autopp"
    checked = [n for n in notes if "attention checked" in n]
    assert len(checked) == 1 and "softcap=5" in checked[0] and "sliding_window" in checked[0]
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert_all_parity(grads, ref_grads, what="gemma2 grad")


def test_a_feature_autopp_lacks_runs_as_the_models_own_attention(caplog):
    """Attention sinks (``s_aux``, a keyword autopp's op does not take): the layer runs the
    model's own attention function with autopp's mask, logged as a warning and named in the
    notes; loss and every gradient (the sinks' included) equal the model's own, and the
    sinks change the numbers (so the check is not vacuous)."""
    from autopp import adapters, init_module_

    ref = init_module_(sink_llama(device="cpu"), seed=0, device="cpu")
    ref_loss, ref_grads = _loss_and_grads(ref)
    assert ref_grads["model.layers.0.self_attn.sinks"].abs().sum() > 0
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sink
    assert abs(_loss_and_grads(ref)[0] - ref_loss) > 1e-3
    model = init_module_(sink_llama(device="cpu"), seed=0, device="cpu")
    with caplog.at_level(logging.WARNING, logger="autopp"):
        notes = adapters.prepare(model)
    assert any("s_aux" in r.message and "model's own attention" in r.message
               for r in caplog.records)
    assert any("gpt_oss" in n and "s_aux" in n for n in notes), notes
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert_all_parity(grads, ref_grads, what="sink llama grad")


def test_a_mask_autopp_cannot_build_is_refused_by_name():
    """A model whose own masks differ from causal (a prefix-LM mask: the first 4 tokens see
    each other, registered as its attention implementation's mask) is refused before it
    runs, naming the attention, both differences and the mask settings."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, or_masks
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from autopp import adapters

    def prefix_lm_mask(*args, mask_function=None, **kwargs):
        prefix = lambda b, h, q, kv: kv < 4  # noqa: E731
        return eager_mask(*args, mask_function=or_masks(mask_function, prefix), **kwargs)

    AttentionInterface.register("prefix_lm", eager_attention_forward)
    AttentionMaskInterface.register("prefix_lm", prefix_lm_mask)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    config._attn_implementation = "prefix_lm"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: autopp's attention does not "
                                         r"reproduce the model's own for LlamaAttention\(") as e:
        adapters.prepare(model)
    assert "autopp: " in str(e.value) and "with autopp's mask: " in str(e.value)
    assert "mask settings" in str(e.value)


def test_an_attention_call_the_check_has_not_seen_is_refused():
    """A keyword the check never saw (here ``output_attentions=True``, which would ask for
    the attention weights autopp's op does not return) is refused by name, not dropped."""
    from autopp import adapters
    from autopp.adapters.transformers_attention import attention

    meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    adapters.prepare(meta)
    module = meta.model.layers[0].self_attn
    q = torch.randn(1, 2, 4, 16)
    attention(module, q, q, q, None, scaling=0.25)  # the checked call
    with pytest.raises(ValueError, match=r"\['output_attentions'\], which autopp's attention "
                                         r"check has not seen"):
        attention(module, q, q, q, None, scaling=0.25, output_attentions=True)


BUDGET = 4.2e5
"""Parameter bytes per device that the tiny models' stages fit only with their blocks'
attention and MLP weights split over tp (the least-memory plan needs 0.392 MiB)."""


@pytest.mark.multiprocess
def test_attention_variants_planned_over_tp_and_replicated_match_the_models_own():
    """pp2 × tp2 planned with every layer's query projection split over tp (so attention
    runs on head shards): Gemma2 with softcap, windows and its scaling, and the sinks model
    (the model's own attention function, shown by ``describe()``); Gemma2 replicated at
    pp2 × dp2 too. Loss and every gradient equal the model's own single-process run."""
    from tests.harness.attention_models import MODELS as ATTENTION_MODELS
    from tests.harness.workers.attention import one_step
    from tests.harness.case import Case
    from tests.harness.launch import run_on_ranks
    from tests.harness.parity import assert_norm_parity
    from tests.harness.reference import reference_run

    planned = dict(pp=2, tp=2, planner_options=dict(parameter_budget_bytes=BUDGET))
    configs = [Case(model="hf_gemma2_variants", **planned),
               Case(model="hf_gemma2_variants", pp=2, dp=2, parallelize=None),
               Case(model="hf_sink_llama", **planned)]
    results = run_on_ranks(one_step, 4, configs, timeout=1200)
    for i, cfg in enumerate(configs):
        ref = reference_run(ATTENTION_MODELS[cfg.model](cfg.n_layers),
                            [make_batch(cfg.batch, cfg.seq)])
        sharded, seen = set(), set()
        for rank in results:
            got = rank[i]
            assert got["losses"][0] == pytest.approx(ref.losses[0], abs=1e-5), cfg
            assert_all_parity(got["grads"], ref.grads, what=f"{cfg.model} grad")
            assert_norm_parity(got["grad_norms"], ref.grads, what=f"{cfg.model} grad")
            seen |= set(got["grad_norms"])
            sharded |= set(got["tp_sharded"])
            assert "attention checked against the model's own" in got["describe"]
            if cfg.model == "hf_sink_llama":
                assert "s_aux" in got["describe"] and "gpt_oss" in got["describe"]
        assert seen == {n for n, _ in ATTENTION_MODELS[cfg.model](cfg.n_layers)
                        .named_parameters()}, cfg
        if cfg.planner_options is not None:
            assert {f"model.layers.{n}.self_attn.q_proj.weight"
                    for n in range(cfg.n_layers)} <= sharded, sorted(sharded)


def test_a_model_that_calls_no_attention_function_keeps_its_own():
    """Falcon computes attention in its own module code, never through transformers'
    attention interface: the check records no call, says so, and leaves the model's
    implementation (and so its masks and numbers) as they were."""
    from autopp import adapters, init_module_

    config = transformers.FalconConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4)
    with torch.device("cpu"):
        model = init_module_(transformers.FalconForCausalLM(config), seed=0, device="cpu")
    before = model.config._attn_implementation
    ref_loss, ref_grads = _loss_and_grads(model)
    notes = adapters.prepare(model)
    assert model.config._attn_implementation == before
    assert any("no attention call goes through transformers' attention interface" in n
               for n in notes), notes
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert_all_parity(grads, ref_grads, what="falcon grad")


def test_capped_scores_hold_one_block_of_scores_not_one_per_head():
    """At seq 2048 with 8 heads, no single allocation of the capped attention's forward and
    backward (CPU allocator's numbers) reaches the score tensor of every head (128 MiB):
    the largest is one block's (:data:`~autopp.ops.attention_blockwise.BLOCK_BYTES`)."""
    from torch.profiler import ProfilerActivity, profile

    seq, heads = 2048, 8
    q = torch.randn(1, heads, seq, 16, requires_grad=True)
    k = torch.randn(1, heads, seq, 16, requires_grad=True)
    v = torch.randn(1, heads, seq, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, _ = torch.ops.autopp.sdpa(q, k, v, True, 0.25, False, None, 30.0)
        out.sum().backward()
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest <= attention_blockwise.BLOCK_BYTES, f"{largest / 2**20:.1f} MiB"
    assert 4 * seq * seq * heads >= 2 * largest
