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


def make_batch(batch: int, seq: int, vocab: int = 2048, seed: int = 0):
    """Tokens and targets; some targets ignored, unevenly across the batch (the
    normalisation trap: per-microbatch means would be wrong)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    target = torch.randint(0, vocab, (batch, seq), generator=g)
    for b in range(batch):
        target[b, : (b * 5) % seq] = -100
    return tokens, target


def reference_step(n_layers: int, tokens, target, seed: int = 0, param_dtype=None):
    """Single-process loss and gradients (by FQN) of the whole model: fp32, or with its
    parameters cast to ``param_dtype`` for the forward (fp32 masters and gradients)."""
    from autopp import init_module_
    from autopp.sharding.precision import CastParams

    model = llama3_meta(n_layers)
    init_module_(model, seed=seed, device="cpu")
    run = model if param_dtype is None else CastParams(model, param_dtype)
    loss = ce_loss(run(tokens), target)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss), grads, model


def reference_adamw_losses(n_layers: int, batch: int, seq: int, *, steps: int, lr: float,
                           max_norm: float, data_seed0: int = 100) -> list[float]:
    """Single-process losses of ``steps`` AdamW steps with global-norm clipping; step k
    trains on ``make_batch(batch, seq, seed=data_seed0 + k)``."""
    from autopp import init_module_

    model = init_module_(llama3_meta(n_layers), seed=0, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tok, tgt = make_batch(batch, seq, seed=data_seed0 + step)
        loss = ce_loss(model(tok), tgt)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return losses
