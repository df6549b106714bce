"""Hugging Face transformers decoders, unchanged, through ``pipeline_autoparallel``.

The models are transformers' own classes built from small configs in code (nothing is
downloaded), on meta. Each trains two AdamW steps with clipping at pp2 × dp2 × tp2 on 8 gloo
processes and matches the single-process model run by transformers itself (its own "sdpa"
attention, plain torch AdamW), fp32 within the suite's bounds; the planner takes its
block-reuse path (pre, each block, post), never one flat graph."""

from __future__ import annotations

import pytest
import torch

from tests.harness.workers.decoder import run
from tests.harness.case import Case, parity_options
from tests.harness.launch import run_on_ranks
from tests.harness.reference import Reference, reference_run
from tests.harness.models import MODELS, ce_loss, logits_of, make_batch
from tests.harness.parity import assert_all_parity, assert_norm_parity

pytest.importorskip("transformers")

N_LAYERS, BATCH, SEQ, LR, MAX_NORM = 4, 8, 16, 1e-2, 0.5


def _reference(kind: str) -> Reference:
    """The model built on CPU as transformers builds it, initialised by autopp's per-FQN
    seeds (each module by the model's own ``_init_weights``), run by transformers' forward
    with its default attention; plain AdamW and clip_grad_norm_: a step, then the loss."""
    import transformers

    meta = MODELS[kind](N_LAYERS)
    with torch.device("cpu"):
        model = type(meta)(meta.config)
    assert model.config._attn_implementation == "sdpa"  # transformers' own path
    assert isinstance(model, transformers.PreTrainedModel)
    batch = make_batch(BATCH, SEQ)
    return reference_run(model, [batch, batch], lr=LR, max_norm=MAX_NORM)


TP_BUDGET = 2.2e5
"""Parameter bytes per device that the suite's tiny decoders fit at pp2 × dp2 × tp2 only with
their blocks' weights split over tp as well as dp, so planned tests exercise tensor
parallelism (at these sizes the CPU profile's fastest plan keeps blocks whole)."""


def _planned(parallelize) -> bool:
    from autopp.backends import Planner

    return parallelize == "auto" or isinstance(parallelize, Planner)


def assert_blocks_split_over_tp(placements: dict, n_layers: int) -> None:
    """Every block holds a weight split over tp (the sub-mesh's last dim), and some block's
    attention projection is split over tp (attention then runs on head shards)."""
    over_tp = {fqn for fqn, p in placements.items() if str(p[-1]).startswith("S")}
    for n in range(n_layers):
        assert any(f".layers.{n}." in f for f in over_tp), (n, sorted(placements.items()))
    assert any("attn" in f and "proj" in f for f in over_tp), sorted(over_tp)


def _check(configs: list[Case], results: list[list[dict]]) -> None:
    for i, cfg in enumerate(configs):
        ref = _reference(cfg.model)
        seen, placements = set(), {}
        for rank_results in results:
            res = rank_results[i]
            assert res["losses"] == pytest.approx(ref.losses, abs=1e-5), cfg
            assert res["norm"] == pytest.approx(ref.norm, rel=1e-5), cfg
            assert_all_parity(res["grads"], ref.grads, what=f"{cfg.model} grad")
            assert_norm_parity(res["grad_norms"], ref.grads, what=f"{cfg.model} grad")
            seen |= set(res["grad_norms"])
            if not _planned(cfg.parallelize):
                continue
            placements.update(res["placements"])
            for sid, units in res["units"].items():  # the block-reuse path
                assert "" not in units, units
                assert any(".layers." in f".{u}" for u in units), units
                assert units[0] == "pre" if sid == 0 else units[-1] == "post", units
        names = {n for n, _ in MODELS[cfg.model](N_LAYERS).named_parameters()}
        assert seen == names, (cfg.model, names ^ seen)
        if _planned(cfg.parallelize):
            assert_blocks_split_over_tp(placements, N_LAYERS)


def _configs(models_and_backends) -> list[Case]:
    """pp2 × dp2 × tp2 cases; "auto" plans under :data:`TP_BUDGET`."""
    from autopp.backends import Planner

    budget = Planner(parity_options(parameter_budget_bytes=TP_BUDGET))
    return [Case(model=model, pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
                 n_layers=N_LAYERS, batch=BATCH, seq=SEQ, lr=LR, max_norm=MAX_NORM,
                 parallelize=budget if parallelize == "auto" else parallelize)
            for model, parallelize in models_and_backends]


def _hf_loss(path: str) -> float:
    """transformers' own loss on the fixed batch of the directory ``path``
    (``from_pretrained``)."""
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokens, target = make_batch(BATCH, SEQ)
    with torch.no_grad():
        return float(ce_loss(logits_of(loaded(tokens)), target))


@pytest.mark.multiprocess
def test_transformers_qwen3_planned_and_hf_checkpoints(tmp_path):
    """Qwen3 (tied embeddings, on different pp ranks) planned matches transformers. Then Hugging Face checkpoints: a ``save_pretrained`` directory (sharded
    safetensors, tied embeddings) loads into a planned pp2 × dp2 × tp2 pipeline with
    transformers' own loss of that directory; after one AdamW step the pipeline saves a
    directory that ``from_pretrained`` loads with the pipeline's eval loss, and that loads
    into pp4 × dp1 × tp2 too."""
    from autopp import init_module_
    from tests.harness.workers.decoder import run_then_round_trip

    kind = "hf_qwen3"
    meta = MODELS[kind](N_LAYERS)
    with torch.device("cpu"):
        model = type(meta)(meta.config)
    init_module_(model, seed=3, device="cpu")
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    model.save_pretrained(src, max_shard_size="300KB")
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 1  # sharded

    configs = _configs([("hf_qwen3", "auto")])
    results = run_on_ranks(run_then_round_trip, 8, configs, str(tmp_path), src, dst, kind,
                           timeout=900)
    _check(configs, [r[0] for r in results])
    src_loss = _hf_loss(src)
    for _, r in results:
        assert r["loaded"] == pytest.approx(src_loss, abs=1e-5)
        assert r["trained"] != pytest.approx(r["loaded"], abs=1e-4)  # the step moved it
        assert r["reloaded"] == pytest.approx(r["trained"], abs=1e-5)
    assert _hf_loss(dst) == pytest.approx(results[0][1]["trained"], abs=1e-5)


@pytest.mark.wide
@pytest.mark.multiprocess
def test_transformers_families_planned_match_single_process(tmp_path):
    """Llama, Qwen2, Mistral and Gemma planned; Qwen3 through a user ``parallelize``
    function; Llama replicated (no planner)."""
    from tests.harness.workers.decoder import fsdp_parallelize

    configs = _configs([("hf_llama", "auto"), ("hf_qwen2", "auto"), ("hf_mistral", "auto"),
                        ("hf_gemma", "auto"), ("hf_qwen3", fsdp_parallelize),
                        ("hf_llama", None)])
    _check(configs, run_on_ranks(run, 8, configs, str(tmp_path), timeout=1500))


@pytest.mark.parametrize("kind", ["hf_llama", "hf_qwen3", "hf_gemma"])
def test_buffers_and_weights_are_the_models_own(kind):
    """Built on meta and initialised by autopp: every buffer (RoPE ``inv_freq``) equals the
    one transformers computes when it builds the model on CPU, exactly; every parameter
    equals the model's own ``_init_weights`` of its module run under the module's per-FQN
    seed (so the weights do not depend on the split). On the previous code the norms (no
    ``reset_parameters``) raised, and buffers had no recomputation."""
    from autopp import init_module_
    from autopp.init import fqn_seed

    meta = MODELS[kind](2)
    with torch.device("cpu"):
        cpu = type(meta)(meta.config)
    got = init_module_(meta, seed=5, device="cpu")
    buffers = dict(cpu.named_buffers())
    assert "model.rotary_emb.inv_freq" in buffers
    for name, b in got.named_buffers():
        assert torch.equal(b, buffers[name]), name
    for mod_fqn, mod in cpu.named_modules():
        if not list(mod.parameters(recurse=False)):
            continue
        torch.manual_seed(fqn_seed(5, mod_fqn))
        cpu._init_weights(mod)
    for name, p in cpu.named_parameters():
        assert torch.equal(got.get_parameter(name), p), name
    # the model's own distributions: normal(0, initializer_range) weights; norms at ones,
    # Gemma's at zeros (it scales by 1 + weight)
    std = float(got.model.layers[0].mlp.gate_proj.weight.std())
    assert abs(std - meta.config.initializer_range) < 0.003, std
    norm = 0.0 if kind == "hf_gemma" else 1.0
    assert torch.equal(got.model.norm.weight, torch.full_like(got.model.norm.weight, norm))



def _separate_documents(model: torch.nn.Module, tokens, target, lengths) -> dict:
    """Loss (the mean over every counted target) and gradients of ``model`` run on each
    document of a packed batch alone, by transformers' own forward (plain causal attention
    over one document; no positions, no mask)."""
    model.zero_grad()
    total, count = 0.0, 0
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            doc = slice(start, start + n)
            logits = logits_of(model(tokens[b:b + 1, doc], use_cache=False)).float()
            total = total + torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), target[b, doc], ignore_index=-100, reduction="sum")
            count += int((target[b, doc] != -100).sum())
            start += n
    loss = total / count
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _cpu_hf_llama(n_layers: int) -> torch.nn.Module:
    """transformers' Llama of the suite's config built on CPU as transformers builds it,
    initialised under autopp's per-FQN seeds (each module by the model's own init)."""
    from autopp import init_module_

    meta = MODELS["hf_llama"](n_layers)
    with torch.device("cpu"):
        model = type(meta)(meta.config)
    return init_module_(model, seed=0, device="cpu")


def test_packed_documents_attend_only_within_themselves():
    """A padding-free packed batch (three documents a row, ``position_ids`` restarting at
    each): autopp's attention keeps each token in its own document, as transformers' own
    model does (training, no cache), so loss and gradients equal running every document
    alone; the mask is one boolean per sequence, never one per head (measured: no allocation
    of attention at seq 2048 reaches one fp32 seq x seq tensor per head)."""
    from torch.profiler import ProfilerActivity, profile

    import transformers

    from autopp import adapters
    from tests.harness.workers.decoder import packed_batch

    model = _cpu_hf_llama(2)
    tokens, target, positions, lengths = packed_batch(4, SEQ)
    theirs = logits_of(model(tokens, position_ids=positions, use_cache=False))
    ref = _separate_documents(model, tokens, target, lengths)
    adapters.prepare(model)
    model.zero_grad()
    loss = ce_loss(logits_of(model(tokens, position_ids=positions)), target)
    loss.backward()
    assert loss.item() == pytest.approx(ref["loss"], abs=1e-6)
    assert_all_parity({n: p.grad for n, p in model.named_parameters()}, ref["grads"],
                      what="packed llama grad")
    with torch.no_grad():
        torch.testing.assert_close(logits_of(model(tokens, position_ids=positions)), theirs,
                                   atol=1e-5, rtol=1e-5)
        # an attention_mask turns packing off (transformers' rule): the same positions,
        # attending across documents
        across = ce_loss(logits_of(model(tokens, position_ids=positions,
                                         attention_mask=torch.ones_like(tokens))), target)
    assert abs(across.item() - ref["loss"]) > 1e-3

    # attention's memory at seq 2048, 8 heads: the largest allocation of any op in a forward
    # and backward is torch's one fp32 mask per sequence (s * s * 4 bytes; the boolean one is
    # s * s), an eighth of one fp32 score tensor for every head
    seq, heads = 2048, 8
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=heads,
                                      num_key_value_heads=heads)
    long = transformers.LlamaForCausalLM(config)
    adapters.prepare(long)
    pos = torch.cat([torch.arange(n) for n in (700, 900, seq - 1600)])[None]
    tok = torch.zeros(1, seq, dtype=torch.long)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits_of(long(tok, position_ids=pos)).float().sum().backward()
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest <= 4 * seq * seq, f"{largest / 2**20:.1f} MiB allocated by one op"
    assert 4 * seq * seq * heads > 4 * largest


def _padded_reference(shift: int) -> dict:
    """transformers' own model (its "sdpa" attention) on the whole padded batch with its
    mask: loss and gradients."""
    from tests.harness.workers.decoder import padded_batch

    model = _cpu_hf_llama(N_LAYERS)
    tokens, target, mask = padded_batch(BATCH, SEQ, shift)
    loss = ce_loss(logits_of(model(tokens, attention_mask=mask)), target)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _packed_reference(shift: int) -> dict:
    """transformers' own model on every document of the packed batch alone."""
    from tests.harness.workers.decoder import packed_batch

    tokens, target, _, lengths = packed_batch(BATCH, SEQ, shift)
    return _separate_documents(_cpu_hf_llama(N_LAYERS), tokens, target, lengths)


@pytest.mark.multiprocess
def test_padded_and_packed_batches_reach_every_stage():
    """A padding ``attention_mask`` passed to ``step`` reaches every stage (pp=2 × dp=2,
    1F1B, stages replicated): loss and gradients equal transformers' own model run on the
    whole padded batch with that mask; without the mask the loss differs (so the later stage
    really used it). In the same launch, a packed batch's ``position_ids`` reach every stage
    of a pp=2 × tp=2 pipeline (a user tensor-parallel ``parallelize``): loss and gradients
    equal running every document alone.

    Then planned stages (``parallelize="auto"``, pp=2 × tp=2) built with
    ``example_kwargs``: the padded batch's mask, and the packed batch's positions, each
    stepped twice from the same weights with a different mask / document layout: every
    step's loss, eval loss and gradient equal the single-process reference of that batch
    (so the mask is an input of the planned graphs, not a constant of one batch's trace),
    and a step without the keyword input is refused with the fix."""
    from tests.harness.workers.decoder import masked_steps, padded_batch, packed_batch

    shifts = [0, 5]
    cfg = Case(model="hf_llama", pp=2, dp=2, schedule="1F1B", n_microbatches=2,
               n_layers=N_LAYERS, batch=BATCH, seq=SEQ, shifts=tuple(shifts))
    meta = MODELS["hf_llama"](N_LAYERS)
    with torch.device("cpu"):
        model = type(meta)(meta.config)
    from autopp import init_module_

    model = init_module_(model, seed=0, device="cpu")
    tokens, target, mask = padded_batch(BATCH, SEQ)
    assert (mask == 0).any() and (mask == 1).any()
    ref = ce_loss(logits_of(model(tokens, attention_mask=mask)), target)
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():
        unmasked = ce_loss(logits_of(model(tokens)), target).item()
    assert abs(unmasked - ref.item()) > 1e-3  # the mask changes the loss
    tokens_p, target_p, _, lengths = packed_batch(BATCH, SEQ)
    packed_ref = _separate_documents(_cpu_hf_llama(N_LAYERS), tokens_p, target_p, lengths)
    planned_refs = {"padded": [_padded_reference(s) for s in shifts],
                    "packed": [_packed_reference(s) for s in shifts]}
    for refs in planned_refs.values():  # the two batches of each kind differ
        assert abs(refs[0]["loss"] - refs[1]["loss"]) > 1e-3
    results = run_on_ranks(masked_steps, 4, cfg, timeout=1200)
    seen_packed = set()
    for r in results:
        p = r["packed"]
        assert p["loss"] == pytest.approx(packed_ref["loss"], abs=1e-5)
        assert p["eval"] == pytest.approx(packed_ref["loss"], abs=1e-5)
        assert abs(p["eval_unpacked"] - p["eval"]) > 1e-3
        assert_all_parity(p["grads"], packed_ref["grads"], what="packed llama grad")
        seen_packed |= set(p["grads"])
        assert [n for n in p["tp_sharded"] if "_proj" in n], p["tp_sharded"]
    assert seen_packed == set(packed_ref["grads"])
    seen = set()
    for r in results:
        assert r["loss"] == pytest.approx(ref.item(), abs=1e-5)
        assert r["eval"] == pytest.approx(ref.item(), abs=1e-5)
        assert r["eval_unmasked"] == pytest.approx(unmasked, abs=1e-5)
        assert_all_parity(r["grads"], ref_grads, what="padded llama grad")
        seen |= set(r["grads"])
        assert r["bad_kwarg"].startswith("keyword input 'attention_mask' is a tensor of "
                                         "shape (1, 16)"), r["bad_kwarg"]
        assert "dim 0 is this dp rank's batch (4)" in r["bad_kwarg"], r["bad_kwarg"]
    assert seen == set(ref_grads)
    for kind, refs in planned_refs.items():
        seen = [set() for _ in shifts]
        for r in results:
            planned = r[f"planned_{kind}"]
            for i, (got, want) in enumerate(zip(planned["steps"], refs)):
                what = f"planned {kind} step {i}"
                assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), what
                assert got["eval"] == pytest.approx(want["loss"], abs=1e-5), what
                assert_all_parity(got["grads"], want["grads"], what=f"{what} grad")
                seen[i] |= set(got["grads"])
            assert "planned for [['" in planned["refused"], planned["refused"]
            assert "example_kwargs" in planned["refused"], planned["refused"]
        assert all(s == set(refs[0]["grads"]) for s in seen), kind


def test_a_padding_mask_and_a_sliding_window_apply_as_the_models_own():
    """autopp's attention applies a 2-D padding mask exactly as transformers' own SDPA path
    does (left padding changes the loss), and a sliding window shorter than the sequence as
    the model's own attention does (the window changes the loss), forward and backward."""
    import transformers

    from autopp import adapters, init_module_
    from tests.harness.workers.decoder import padded_batch

    meta = MODELS["hf_llama"](2)
    with torch.device("cpu"):
        model = type(meta)(meta.config)
    model = init_module_(model, seed=0, device="cpu")
    tokens, target, mask = padded_batch(4, SEQ)
    theirs = ce_loss(logits_of(model(tokens, attention_mask=mask)), target).item()
    unmasked = ce_loss(logits_of(model(tokens)), target).item()
    adapters.prepare(model)
    assert model.config._attn_implementation == "autopp"
    assert ce_loss(logits_of(model(tokens, attention_mask=mask)), target).item() == \
        pytest.approx(theirs, abs=1e-6)
    assert ce_loss(logits_of(model(tokens)), target).item() == pytest.approx(unmasked, abs=1e-6)
    assert abs(theirs - unmasked) > 1e-3

    def mistral(window):
        config = transformers.MistralConfig(
            vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, sliding_window=window,
            initializer_range=0.2)
        with torch.device("cpu"):
            return init_module_(transformers.MistralForCausalLM(config), seed=0, device="cpu")

    def run(model):
        loss = ce_loss(logits_of(model(tokens)), target)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = run(mistral(4))
    assert abs(run(mistral(None))[0] - ref_loss) > 1e-3  # the window acts at seq 16
    ours = mistral(4)
    adapters.prepare(ours)
    loss, grads = run(ours)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert_all_parity(grads, ref_grads, what="sliding-window mistral grad")
