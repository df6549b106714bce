"""Stage units read off the model's own forward (autopp.tracing.units), nested and found
layer containers, and tied parameters: single process, on meta or CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autopp.init import init_module_
from autopp.tracing.units import BlockCall, stage_units, unit_signature
from autopp.stage_split import build_stage_module, inspect_model, merge_stage_modules
from autopp.stage_split.build import Skipped
from tests.harness.models import hf_meta, llama3_meta, qwen3_meta


class Toy(nn.Module):
    """A plain nn.Module: no torchtitan names, Sequential blocks, glue around them."""

    def __init__(self, skip: bool = False, mask_from_input: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(3))
        self.out = nn.Linear(16, 32)
        self.skip, self.mask_from_input = skip, mask_from_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * 4.0 if self.embed is not None else x
        e = h
        for block in self.blocks:
            h = block(h * (x > 0).unsqueeze(-1) if self.mask_from_input else h)
        if self.skip:
            h = h + e
        return self.out(torch.relu(h)) if self.out is not None else h


def _meta(cls=Toy, **kw):
    with torch.device("meta"):
        return cls(**kw)


def _run_units(units, x):
    for u in units:
        x = u.module(x)
    return x


def test_plain_module_units_follow_its_forward():
    model = init_module_(_meta(), seed=0, device="cpu")
    units = stage_units(model)
    assert [u.name for u in units] == ["pre", "blocks.0", "blocks.1", "blocks.2", "post"]
    assert len({unit_signature(u) for u in units if isinstance(u.module, BlockCall)}) == 1
    fqns = {u.stage_fqn(n) for u in units for n, _ in u.module.named_parameters()}
    assert fqns == {n for n, _ in model.named_parameters()}
    x = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(_run_units(units, x), model(x), atol=0, rtol=0)  # glue kept


@pytest.mark.parametrize("kw, why", [
    (dict(skip=True), "after the blocks reads"),
    (dict(mask_from_input=True), "first argument"),
])
def test_forwards_outside_the_pattern_are_planned_flat(kw, why, caplog):
    with caplog.at_level(logging.INFO, logger="autopp"):
        assert stage_units(_meta(**kw)) is None
    assert why in caplog.text


def test_tied_within_one_stage_is_planned_flat(caplog):
    with caplog.at_level(logging.INFO, logger="autopp"):
        assert stage_units(qwen3_meta(2)) is None
    assert "tied between pre and post" in caplog.text


def test_nested_decoder_units_and_buffer_arguments():
    model = hf_meta(4)
    layout = inspect_model(model)
    assert layout.layers_attr == "model.layers"
    assert layout.pre == ("model.embed_tokens",) and layout.post == ("model.norm", "lm_head")
    stage = build_stage_module(model, ["model.layers.2", "model.layers.3", "model.norm",
                                       "lm_head"])
    assert isinstance(stage.model.embed_tokens, Skipped) and list(stage.model.layers.keys()) == ["2", "3"]
    units = stage_units(stage)
    assert [u.name for u in units] == ["model.layers.2", "model.layers.3", "post"]
    block = units[0]
    # the RoPE table the model's forward hands every layer, read from the stage's buffer
    assert [block.stage_fqn(n) for n, _ in block.module.named_buffers()] == ["model.rope"]
    assert unit_signature(units[0]) == unit_signature(units[1])
    # numerically: the units chained equal the model's own forward (materialised)
    whole = init_module_(hf_meta(4), seed=0, device="cpu")
    units = stage_units(whole)
    assert [u.name for u in units][0] == "pre" and units[-1].name == "post"
    x = torch.randint(0, 2048, (2, 8))
    torch.testing.assert_close(_run_units(units, x), whole(x), atol=0, rtol=0)


def test_nested_split_merges_back_to_whole_model_names():
    model = hf_meta(4)
    a = build_stage_module(model, ["model.embed_tokens", "model.layers.0", "model.layers.1"])
    b = build_stage_module(model, ["model.layers.2", "model.layers.3", "model.norm", "lm_head"])
    merged = merge_stage_modules([a, b])
    assert {n for n, _ in merged.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_layer_container_errors():
    with pytest.raises(ValueError, match="no module 'decoder.layers'.*layers_attr="):
        inspect_model(hf_meta(2), "decoder.layers")
    with pytest.raises(ValueError, match="no nn.ModuleList or nn.ModuleDict of repeated"):
        inspect_model(nn.Sequential(nn.Linear(2, 2)))


def test_llama3_units_keep_torchtitan_order():
    names = [u.name for u in stage_units(llama3_meta(3))]
    assert names == ["pre", "layers.0", "layers.1", "layers.2", "post"]


def test_find_tied_and_init_keeps_ties():
    from autopp.tied import find_tied

    model = qwen3_meta(2)
    split = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]
    (t,) = find_tied(model, split)
    assert t.name == "tok_embeddings.weight" and t.init_stage == 1
    assert t.stage_fqns == ((0, "tok_embeddings.weight"), (1, "lm_head.weight"))
    assert find_tied(model, [[f for s in split for f in s]]) == []
    with pytest.raises(ValueError, match="shared \\(tied\\)"):
        build_stage_module(model, split[0])
    whole = init_module_(qwen3_meta(2), seed=0, device="cpu")
    assert whole.tok_embeddings.weight is whole.lm_head.weight
    assert whole.lm_head.weight.abs().max() < 1  # the head's initialiser, not garbage


def _tiny_llama_last_stage():
    """A 2-layer transformers Llama on meta, prepared by autopp's adapter: the stage of its
    second layer and its head."""
    import transformers

    from autopp import adapters

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    adapters.prepare(model)
    layout = inspect_model(model)
    return build_stage_module(model, [*layout.layer_fqns[1:], *layout.post])


@pytest.mark.parametrize("name", ["attention_mask", "position_ids"])
def test_keyword_inputs_are_inputs_of_every_unit_and_reach_attention(name):
    """A transformers stage planned with a keyword input: every unit takes it after its
    activation; traced, each block's attention mask (one boolean per sequence, fed to
    ``autopp::sdpa``) is computed from that graph input (the padding mask, or the documents
    the positions give), never a constant, and it gets no gradient. Without the keyword
    input the block traces to plain causal attention."""
    from autopp.tracing.joint import trace_joint

    stage = _tiny_llama_last_stage()
    x = torch.empty(2, 8, 32, device="meta")
    kw = {name: torch.empty(2, 8, dtype=torch.long, device="meta")}
    units = stage_units(stage, x, kw)
    assert [u.name for u in units] == ["model.layers.1", "post"]
    block = units[0].module
    assert block.input_names == (name,)
    joint = trace_joint(block, (x, *kw.values()), differentiable=1)
    assert sorted(joint.inputs) == [0, 1] and list(joint.input_grads) == [0]
    (sdpa,) = [n for n in joint.gm.graph.nodes if str(n.target) == "autopp.sdpa.default"]
    mask = sdpa.args[6]
    assert tuple(mask.meta["val"].shape) == (2, 1, 8, 8)
    seen, stack = set(), [mask]
    while stack:  # the mask's ancestors
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    assert joint.inputs[1] in seen
    # the stage captured without it: causal attention, no mask argument
    (plain,) = stage_units(stage, x)[:1]
    joint = trace_joint(plain.module, (x,))
    (sdpa,) = [n for n in joint.gm.graph.nodes if str(n.target) == "autopp.sdpa.default"]
    assert len(sdpa.args) < 7 or sdpa.args[6] is None


def test_a_stage_is_exported_once_for_every_plan_of_it_while_planning(monkeypatch):
    """Planning captures one stage for every boundary pair and budget it tries: within one
    planning call (``captures_reused``) a transformers stage (exported, fx cannot trace
    it) is exported once and its units come out the same; inputs of another shape export
    again, and outside the call every capture is fresh (a module may change between calls)."""
    from autopp.tracing import unit_export
    from autopp.tracing.units import captures_reused

    stage = _tiny_llama_last_stage()
    calls = []
    real = unit_export.export_at_blocks
    monkeypatch.setattr(unit_export, "export_at_blocks",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.empty(2, 8, 32, device="meta")
    with captures_reused():
        first = stage_units(stage, x)
        again = stage_units(stage, x)
        assert len(calls) == 1
        assert [unit_signature(u) for u in first] == [unit_signature(u) for u in again]
        stage_units(stage, torch.empty(2, 4, 32, device="meta"))
        assert len(calls) == 2
    stage_units(stage, x)
    assert len(calls) == 3
