"""Deterministic init is split-independent; the token-weighted loss equals the global mean."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopp.init import init_module_
from autopp.loss import TokenWeightedLoss
from autopp.stage_split import build_stage_module, resolve_split
from tests.harness.models import ce_loss, llama3_meta, make_batch


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


def _same_distribution(got: torch.Tensor, own: torch.Tensor, what: str) -> None:
    """``got`` drawn from the distribution ``own`` was drawn from: constants equal, std
    within 3%, mean within 6 standard errors, the 0.1%, 1%, 50%, 99% and 99.9% quantiles
    within 0.1 std (a truncated normal's cut, a uniform's bound)."""
    got, own = got.detach().double().flatten(), own.detach().double().flatten()
    if own.std() == 0:
        assert torch.equal(got, own), what
        return
    se = float(own.std()) / own.numel() ** 0.5
    assert abs(float(got.std() / own.std()) - 1) < 0.03, (what, float(got.std()), float(own.std()))
    assert abs(float(got.mean() - own.mean())) < 6 * se + 1e-7, (what, float(got.mean()), float(own.mean()))
    q = torch.tensor([0.001, 0.01, 0.5, 0.99, 0.999], dtype=torch.float64)
    qg, qo = torch.quantile(got, q), torch.quantile(own, q)  # the shape, tails included
    assert float((qg - qo).abs().max()) < 0.1 * float(own.std()), (what, qg, qo)
    assert not torch.equal(got, own), what  # its own stream, not a copy


def test_init_draws_what_the_models_own_init_draws():
    """Against the model's own initialisation, not against autopp: torchtitan's llama3
    ``init_weights()`` (truncated normals with depth-scaled std, ones for norms, its RoPE
    table) and a Hugging Face style model built on CPU (torch's ``reset_parameters``):
    ``init_module_`` on the meta model gives each parameter the same distribution and every
    buffer the same values."""
    from tests.harness.models import HFForCausalLM, hf_meta, llama3_debug_config

    cfg = llama3_debug_config(2)
    torch.manual_seed(0)
    own = cfg.build()
    own.init_weights()
    with torch.device("meta"):
        meta = cfg.build()
    torch.manual_seed(0)
    own_hf = HFForCausalLM(n_layers=2)
    own_hf.model._init_self_buffers()  # the model's own buffer code, on CPU
    for own_model, got in ((own, init_module_(meta, seed=0, device="cpu")),
                           (own_hf, init_module_(hf_meta(2), seed=0, device="cpu"))):
        names = [n for n, _ in own_model.named_parameters()]
        assert names == [n for n, _ in got.named_parameters()]
        for (name, p), (_, q) in zip(own_model.named_parameters(), got.named_parameters()):
            _same_distribution(q, p, name)
        for (name, b), (_, c) in zip(own_model.named_buffers(), got.named_buffers()):
            torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)


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


class _Rotary(nn.Module):
    """A buffer computed in ``__init__`` and nothing that recomputes it (as transformers'
    rotary embeddings and many hand-written models have)."""

    def __init__(self, dim: int = 8, base: float = 10.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim),
                             persistent=False)
        self.register_buffer("mask", torch.ones(4, 4, dtype=torch.bool).tril())


class _RotaryWithHook(_Rotary):
    def _init_self_buffers(self, buffer_device=None):
        fresh = _Rotary()
        self.inv_freq = fresh.inv_freq.to(buffer_device)
        self.mask = fresh.mask.to(buffer_device)


def _model(rotary_cls):
    return nn.ModuleDict({"proj": nn.Linear(8, 8), "rope": rotary_cls(),
                          "norm": nn.BatchNorm1d(8)})


def test_buffers_on_meta_are_recomputed_or_refused_never_garbage():
    """Against the same model built on CPU the ordinary way: every buffer equal exactly
    (a hook recomputes them; BatchNorm's running statistics by its reset_parameters), every
    parameter equal to the module's own initialiser run under autopp's per-FQN seed. A
    buffer nothing recomputes is an error naming it (it came back as uninitialised memory)."""
    from autopp.init import fqn_seed

    cpu = _model(_RotaryWithHook)
    with torch.device("meta"):
        meta = _model(_RotaryWithHook)
    got = init_module_(meta, seed=5, device="cpu")
    for name, b in cpu.named_buffers():
        assert torch.equal(got.get_buffer(name), b), name
    for mod_fqn in ("proj", "norm"):  # reset_parameters under the module's per-FQN seed
        mod = cpu[mod_fqn]
        torch.manual_seed(fqn_seed(5, mod_fqn))
        mod.reset_parameters()
        for name, p in mod.named_parameters():
            assert torch.equal(got[mod_fqn].get_parameter(name), p), (mod_fqn, name)

    with torch.device("meta"):
        bare = _model(_Rotary)
    with pytest.raises(ValueError, match=r"rope\.inv_freq \(_Rotary\), rope\.mask \(_Rotary\) "
                                         r"were built on meta.*_init_self_buffers"):
        init_module_(bare, seed=5, device="cpu")

    half = _model(_Rotary)  # values computed on CPU, parameters moved to meta: kept
    half.proj.to_empty(device="meta")
    got = init_module_(half, seed=5, device="cpu")
    assert torch.equal(got.rope.inv_freq, _Rotary().inv_freq)
    assert torch.equal(got.rope.mask, _Rotary().mask)
