"""transformers decoders whose attention has features autopp's op must reproduce or route to
the model's own function (tests/models/test_attention_check.py and its 4-rank launch)."""

from __future__ import annotations

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaAttention


def gemma2(n_layers: int = 4, device: str = "meta", **changes) -> torch.nn.Module:
    """A tiny Gemma2 whose attention features act at the test's sizes: scores capped at 5
    (weights drawn wide enough that the cap bites), every other layer a window of 4
    positions, and scaling by ``query_pre_attn_scalar`` (64) rather than the head dim (16)."""
    config = dict(vocab_size=2048, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, attn_logit_softcapping=5.0, sliding_window=4,
                  query_pre_attn_scalar=64, initializer_range=0.25,
                  final_logit_softcapping=None)
    config.update(changes)
    from autopp import init_module_

    with torch.device(device):
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**config))
    return model if device == "meta" else init_module_(model, seed=0, device=device)


class SinkLlamaAttention(LlamaAttention):
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
    """:class:`SinkLlamaForCausalLM` of the suite's Llama sizes, its attention function
    registered with transformers."""
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


MODELS = {"hf_gemma2_variants": gemma2, "hf_sink_llama": sink_llama}
