"""What autopp swaps into a transformers model's attention is checked against the model's own:
implemented variants (logit softcapping, sliding windows, per-model scaling) equal the
model's numbers, a feature autopp's op lacks runs as the model's own function (logged, in
the notes ``describe()`` shows), and a mask autopp cannot reproduce is refused by name.
References are transformers' own models run in one process (their eager attention)."""

from __future__ import annotations

import logging

import pytest
import torch

from autopp.ops import attention_blockwise
from tests.models import ce_loss, logits_of, make_batch
from tests.parity import assert_all_parity, assert_parity

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


def _gemma2(**changes):
    """A tiny Gemma2 whose attention features act at the test's sizes: scores capped at 5
    (weights drawn wide enough that the cap bites), every other layer a window of 4
    positions, and scaling by ``query_pre_attn_scalar`` (64) rather than the head dim (16)."""
    config = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, attn_logit_softcapping=5.0, sliding_window=4,
                  query_pre_attn_scalar=64, initializer_range=0.25,
                  final_logit_softcapping=None)
    config.update(changes)
    from autopp import init_module_

    with torch.device("cpu"):
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**config))
    return init_module_(model, seed=0, device="cpu")


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
    ref_loss, ref_grads = _loss_and_grads(_gemma2())
    for off in ({"attn_logit_softcapping": None}, {"sliding_window": 2 * SEQ},
                {"query_pre_attn_scalar": 16}):
        assert abs(_loss_and_grads(_gemma2(**off))[0] - ref_loss) > 1e-3, off
    from autopp import adapters

    model = _gemma2()
    notes = adapters.prepare(model)
    assert model.config._attn_implementation == "autopp"
    checked = [n for n in notes if "attention checked" in n]
    assert len(checked) == 1 and "softcap=5" in checked[0] and "sliding_window" in checked[0]
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert_all_parity(grads, ref_grads, what="gemma2 grad")


class SinkLlamaAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """Llama attention with attention sinks (GPT-OSS's feature: a learned logit per head
    that takes part in the softmax), which autopp's op does not implement."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.sinks = torch.nn.Parameter(torch.empty(config.num_attention_heads))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states, position_embeddings, attention_mask,
                               s_aux=self.sinks, **kwargs)


class SinkLlamaForCausalLM(transformers.LlamaForCausalLM):
    """transformers' Llama with :class:`SinkLlamaAttention` in every layer, run by the
    attention function its config names ("sink_eager": GPT-OSS's eager attention)."""

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = SinkLlamaAttention(config, i)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, SinkLlamaAttention):
            torch.nn.init.normal_(module.sinks, std=1.0)


def sink_llama(n_layers: int = 4, device: str = "meta") -> torch.nn.Module:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    AttentionInterface.register("sink_eager", eager_attention_forward)
    AttentionMaskInterface.register("sink_eager", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sink_eager"
    with torch.device(device):
        return SinkLlamaForCausalLM(config)


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
    from autopp.adapters.transformers_hf import attention

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
