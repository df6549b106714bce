"""Small models for tests: torchtitan's llama3 debugmodel shape with SDPA attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def llama3_debug_config(n_layers: int = 6):
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs["debugmodel"], "sdpa")
    cfg.layers = [cfg.layers[i % len(cfg.layers)] for i in range(n_layers)]
    return cfg


def llama3_meta(n_layers: int = 6) -> torch.nn.Module:
    cfg = llama3_debug_config(n_layers)
    with torch.device("meta"):
        return cfg.build()


def ce_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over counted tokens (ignore_index -100)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100
    )


def sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed squared error (the schedule tests' loss: no mean, so microbatch sums add up)."""
    return ((out - target) ** 2).sum()


def make_batch(batch: int, seq: int, vocab: int = 2048, seed: int = 0):
    """Tokens and targets; some targets ignored, unevenly across the batch (the
    normalisation trap: per-microbatch means would be wrong)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    target = torch.randint(0, vocab, (batch, seq), generator=g)
    for b in range(batch):
        target[b, : (b * 5) % seq] = -100
    return tokens, target


# ---------------------------------------------------------------- other decoders
def qwen3_meta(n_layers: int = 4) -> torch.nn.Module:
    """torchtitan's qwen3 debugmodel (tied input embedding and output head), SDPA attention."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.qwen3 import qwen3_configs

    cfg = build_decoder_config_for_backend(qwen3_configs["debugmodel"], "sdpa")
    cfg.layers = cfg.layers[:n_layers]
    with torch.device("meta"):
        return cfg.build()


class HFRMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class HFAttention(torch.nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = torch.nn.Linear(dim, dim, bias=False)
        self.k_proj = torch.nn.Linear(dim, dim, bias=False)
        self.v_proj = torch.nn.Linear(dim, dim, bias=False)
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, position_embeddings: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        # as transformers' rotary code: the tables in the activations' dtype (a no-op in
        # fp32; under bf16 compute with fp32 buffers, q and k stay bf16 like v)
        cos, sin = (position_embeddings[i, :t].to(q.dtype) for i in (0, 1))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class HFDecoderLayer(torch.nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.input_layernorm = HFRMSNorm(dim)
        self.self_attn = HFAttention(dim, n_heads)
        self.post_attention_layernorm = HFRMSNorm(dim)
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                           position_embeddings)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFModel(torch.nn.Module):
    """The body of a Hugging Face style decoder: blocks at ``model.layers``; the RoPE table
    (cos and sin) is a buffer of this module, handed to every layer."""

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, hidden: int,
                 max_seq: int):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            HFDecoderLayer(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = HFRMSNorm(dim)
        self.head_dim, self.max_seq = dim // n_heads, max_seq
        self.register_buffer("rope", torch.empty(2, max_seq, dim // n_heads), persistent=False)

    def _init_self_buffers(self, buffer_device=None) -> None:
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        ang = torch.outer(torch.arange(self.max_seq).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.rope = torch.stack((ang.cos(), ang.sin())).to(buffer_device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.norm(h) if self.norm is not None else h


class HFForCausalLM(torch.nn.Module):
    """``model.model.layers`` nesting, as Hugging Face's LlamaForCausalLM."""

    def __init__(self, vocab: int = 2048, dim: int = 64, n_layers: int = 4, n_heads: int = 4,
                 hidden: int = 128, max_seq: int = 64):
        super().__init__()
        self.model = HFModel(vocab, dim, n_layers, n_heads, hidden, max_seq)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model(input_ids)
        return self.lm_head(h) if self.lm_head is not None else h


def hf_meta(n_layers: int = 4) -> torch.nn.Module:
    with torch.device("meta"):
        return HFForCausalLM(n_layers=n_layers)


def qwen3_moe_meta(n_layers: int = 4) -> torch.nn.Module:
    """torchtitan's qwen3 ``debugmodel_moe`` (64 experts, top 8, softmax router, expert-bias
    load balancing), SDPA attention, its first ``n_layers`` layers."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.qwen3 import qwen3_configs

    cfg = build_decoder_config_for_backend(qwen3_configs["debugmodel_moe"], "sdpa")
    cfg.layers = cfg.layers[:n_layers]
    with torch.device("meta"):
        return cfg.build()


def deepseek_v3_meta(n_layers: int = 4) -> torch.nn.Module:
    """torchtitan's deepseek_v3 ``debugmodel`` (MLA attention, a dense first layer, then MoE
    layers of 8 experts, top 3, two shared experts), SDPA attention, ``n_layers`` layers."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    cfg = build_decoder_config_for_backend(deepseekv3_configs["debugmodel"], "sdpa",
                                           moe_comm_backend="standard")
    cfg.layers = cfg.layers[:n_layers]
    with torch.device("meta"):
        return cfg.build()


def _transformers_meta(family: str, n_layers: int) -> torch.nn.Module:
    """A Hugging Face transformers decoder as the library builds it (no download: a small
    config in code), on meta: grouped-query attention (4 query heads, 2 key/value heads)."""
    import transformers

    common = dict(vocab_size=2048, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    config, model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }[family]
    extra = {"qwen3": {"head_dim": 16, "tie_word_embeddings": True},
             "gemma": {"head_dim": 16}}.get(family, {})
    with torch.device("meta"):
        return model(config(**common, **extra))


def _transformers_moe_meta(family: str, n_layers: int, **overrides) -> torch.nn.Module:
    """A Hugging Face transformers mixture-of-experts decoder (no download: a small config in
    code), on meta, as :func:`_transformers_meta`: 4 query heads, 2 key/value heads, experts
    of hidden 32 (``overrides``: config fields changed, e.g. ``norm_topk_prob``)."""
    import transformers

    common = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config, model, extra = {
        # 4 experts, top 2, top-k weights renormalised
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                    dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
        # 4 experts, top 2, weights not renormalised, a sigmoid-gated shared expert
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, intermediate_size=48)),
        # 8 experts, top 3 (more than two per token), renormalised
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                           intermediate_size=48, head_dim=16, norm_topk_prob=True)),
        # 8 experts, top 2, not renormalised, q/k norms
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                       eos_token_id=None)),
    }[family]
    with torch.device("meta"):
        return model(config(**common, **{**extra, **overrides}))


def hf_mixtral_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_moe_meta("mixtral", n_layers)


def hf_qwen2_moe_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_moe_meta("qwen2_moe", n_layers)


def hf_qwen3_moe_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_moe_meta("qwen3_moe", n_layers)


def hf_olmoe_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_moe_meta("olmoe", n_layers)


def hf_llama_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_meta("llama", n_layers)


def hf_qwen3_meta(n_layers: int = 4) -> torch.nn.Module:
    """Qwen3 with tied input embedding and output head (``tie_word_embeddings=True``)."""
    return _transformers_meta("qwen3", n_layers)


def hf_qwen2_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_meta("qwen2", n_layers)


def hf_mistral_meta(n_layers: int = 4) -> torch.nn.Module:
    return _transformers_meta("mistral", n_layers)


def hf_gemma_meta(n_layers: int = 4) -> torch.nn.Module:
    """Gemma: embeddings scaled by sqrt(hidden) inside the model's forward, RMSNorm on
    (1 + weight), GELU-tanh MLP, tied input embedding and output head (its default)."""
    return _transformers_meta("gemma", n_layers)


def _gpt2_style_meta(family: str, n_layers: int) -> torch.nn.Module:
    """A GPT-2-style transformers decoder (its forward reads the batch, sequence and
    positions from ``input_ids``; learned absolute positions ``wpe``; ``Conv1D`` weights,
    stored (in, out); ``lm_head`` tied to ``wte``) of the suite's sizes, on meta, dropout
    off (the reference runs the same numbers)."""
    import transformers

    common = dict(vocab_size=2048, n_embd=64, n_layer=n_layers, n_head=4, n_positions=64,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                  eos_token_id=0)
    config, model = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        # multi-query attention (one key/value head), GELU-tanh MLP
        "gpt_bigcode": (transformers.GPTBigCodeConfig, transformers.GPTBigCodeForCausalLM),
    }[family]
    with torch.device("meta"):
        return model(config(**common))


def hf_opt_meta(n_layers: int = 4) -> torch.nn.Module:
    """OPT: its forward reads the batch and sequence from ``input_ids``, learned positions
    from the attention mask's running count (offset by 2), ``lm_head`` tied to the
    embedding; dropout off."""
    import transformers

    config = transformers.OPTConfig(
        vocab_size=2048, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128,
        num_hidden_layers=n_layers, num_attention_heads=4, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, bos_token_id=0,
        eos_token_id=0, pad_token_id=1)
    with torch.device("meta"):
        return transformers.OPTForCausalLM(config)


def hf_gpt2_meta(n_layers: int = 4) -> torch.nn.Module:
    return _gpt2_style_meta("gpt2", n_layers)


def hf_gpt_bigcode_meta(n_layers: int = 4) -> torch.nn.Module:
    return _gpt2_style_meta("gpt_bigcode", n_layers)


class _PositionBlock(torch.nn.Module):
    """A block that takes the positions as an argument, as GPT-2's blocks do."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h))) * (1 + positions[..., None] / 16)


class ReadsItsInput(torch.nn.Module):
    """A GPT-2-like decoder in plain torch whose forward reads ``tokens``' shape: learned
    positions from the sequence length (the blocks take them too), the output viewed back
    to (batch, seq, vocab). Its forward takes no other keyword."""

    def __init__(self, n_layers: int = 4, vocab: int = 2048, dim: int = 64):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(64, dim)
        self.h = torch.nn.ModuleList(_PositionBlock(dim) for _ in range(n_layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device)[None]
        h = self.wte(tokens.view(-1, seq)) + self.wpe(positions)
        for block in self.h:
            h = block(h, positions)
        return self.head(h).view(batch, seq, -1)


def reads_input_meta(n_layers: int = 4) -> torch.nn.Module:
    with torch.device("meta"):
        return ReadsItsInput(n_layers)


def logits_of(out):
    """A transformers ``ModelOutput``'s logits; a tensor as it is."""
    return out if isinstance(out, torch.Tensor) else out.logits


MODELS = {"llama3": llama3_meta, "qwen3": qwen3_meta, "hf": hf_meta,
          "hf_llama": hf_llama_meta, "hf_qwen3": hf_qwen3_meta, "hf_qwen2": hf_qwen2_meta,
          "hf_mistral": hf_mistral_meta, "hf_gemma": hf_gemma_meta,
          "qwen3_moe": qwen3_moe_meta, "deepseek_v3": deepseek_v3_meta,
          "hf_mixtral": hf_mixtral_meta, "hf_qwen2_moe": hf_qwen2_moe_meta,
          "hf_qwen3_moe": hf_qwen3_moe_meta, "hf_olmoe": hf_olmoe_meta}
# forwards that read their input's shape (tests/models/test_gpt2_style_models.py)
MODELS.update(hf_gpt2=hf_gpt2_meta, hf_gpt_bigcode=hf_gpt_bigcode_meta, hf_opt=hf_opt_meta,
              reads_input=reads_input_meta)
