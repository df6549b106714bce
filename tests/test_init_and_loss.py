"""Deterministic init is split-independent; the token-weighted loss equals the global mean."""

from __future__ import annotations

import torch
from torch import nn

from autopp.init import init_module_
from autopp.loss import TokenWeightedLoss
from autopp.stage_split import build_stage_module, resolve_split
from tests.models import ce_loss, llama3_meta, make_batch


def test_stage_init_equals_whole_model_init():
    whole = init_module_(llama3_meta(4), seed=3, device="cpu")
    meta = llama3_meta(4)
    ref = dict(whole.named_parameters()) | dict(whole.named_buffers())
    seen = set()
    for fqns in resolve_split(meta, None, 3):
        stage = init_module_(build_stage_module(meta, fqns), seed=3, device="cpu")
        for k, v in [*stage.named_parameters(), *stage.named_buffers()]:
            torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
            seen.add(k)
    assert {k for k, _ in whole.named_parameters()} <= seen
    other = init_module_(llama3_meta(4), seed=4, device="cpu")
    assert not torch.equal(other.layers["0"].attention.wo.weight, whole.layers["0"].attention.wo.weight)


def test_reset_parameters_modules():
    torch.manual_seed(0)
    a = init_module_(nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to("meta"), seed=1, device="cpu")
    b = init_module_(nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to("meta"), seed=1, device="cpu")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert not p.is_meta
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert a[0].weight.abs().sum() > 0


def test_token_weighted_loss_is_global_mean():
    tokens, target = make_batch(8, 16)
    logits = torch.randn(8, 16, 2048)
    ref = ce_loss(logits, target)
    total_tokens = (target != -100).sum().to(torch.float64)
    loss = TokenWeightedLoss(loss_fn=ce_loss, ignore_index=-100, global_tokens=total_tokens)
    # microbatches of different sizes and different counted-token counts
    pieces = [loss(logits[i : i + 2], target[i : i + 2]) for i in range(0, 8, 2)]
    torch.testing.assert_close(sum(pieces).float(), ref, atol=1e-6, rtol=1e-6)
    # a mean of per-microbatch means differs here (the trap this guards against)
    naive = sum(ce_loss(logits[i : i + 2], target[i : i + 2]) for i in range(0, 8, 2)) / 4
    assert abs(float(naive) - float(ref)) > 1e-4
