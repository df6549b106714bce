"""Tests of autopp.stage_split: uniform/explicit/layout-string splits, errors, stage modules."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

from autopp.stage_split.build import Skipped
from autopp.stage_split import (
    ModelLayout,
    StageLayers,
    build_stage_module,
    format_layout,
    inspect_model,
    parse_layout,
    resolve_split,
    split_uniform,
    validate_split,
)

E = "tok_embeddings"
N, H = "norm", "lm_head"


def layer(i: int) -> str:
    return f"layers.{i}"


def llama3_meta(name: str = "debugmodel", max_seq_len: int | None = None) -> nn.Module:
    """A torchtitan llama3 on meta; ``max_seq_len`` shrinks the RoPE caches (faster init)."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs[name], "sdpa")
    if max_seq_len is not None:
        for layer_cfg in cfg.layers:
            layer_cfg.attention.rope = dataclasses.replace(
                layer_cfg.attention.rope, max_seq_len=max_seq_len
            )
    with torch.device("meta"):
        return cfg.build()


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    """torchtitan llama3 debugmodel on meta: tok_embeddings, layers "0".."5", norm, lm_head."""
    return llama3_meta()


@pytest.fixture(scope="module")
def llama_layout(llama: nn.Module) -> ModelLayout:
    return inspect_model(llama)


class Toy(nn.Module):
    """A ModuleList model whose forward skips None modules, like torchtitan's decoders."""

    def __init__(self, vocab: int = 32, dim: int = 16, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers:
            h = block(h)
        return self.head(h) if self.head is not None else h


def toy_meta(**kwargs: int) -> Toy:
    with torch.device("meta"):
        return Toy(**kwargs)


# ---------------------------------------------------------------- inspect_model


def test_inspect_llama(llama_layout: ModelLayout) -> None:
    assert llama_layout == ModelLayout(
        pre=(E,), layers_attr="layers", layer_names=tuple("012345"), post=(N, H)
    )
    assert llama_layout.n_layers == 6
    assert llama_layout.fqns == (E, *map(layer, range(6)), N, H)


def test_inspect_module_list() -> None:
    assert inspect_model(toy_meta()) == ModelLayout(("embed",), "layers", tuple("0123"), ("head",))


def test_inspect_errors() -> None:
    with pytest.raises(ValueError, match=r"no module 'blocks'.*'embed', 'layers'"):
        inspect_model(toy_meta(), layers_attr="blocks")
    with pytest.raises(ValueError, match=r"Toy.head is a Linear"):
        inspect_model(toy_meta(), layers_attr="head")
    with pytest.raises(ValueError, match="holds no layers"):
        inspect_model(toy_meta(n_layers=0), layers_attr="layers")
    with pytest.raises(ValueError, match="no nn.ModuleList or nn.ModuleDict of repeated blocks"):
        inspect_model(toy_meta(n_layers=0))
    model = toy_meta()
    model.scale = nn.Parameter(torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match=r"root module\) has parameters directly on it \(\['scale'\]\)"):
        inspect_model(model)


# ---------------------------------------------------------------- uniform


UNIFORM_EXPECTED = {
    1: [[E, *map(layer, range(6)), N, H]],
    2: [[E, layer(0), layer(1), layer(2)], [layer(3), layer(4), layer(5), N, H]],
    3: [[E, layer(0), layer(1)], [layer(2), layer(3), layer(4)], [layer(5), N, H]],
    4: [[E, layer(0)], [layer(1), layer(2)], [layer(3), layer(4)], [layer(5), N, H]],
    8: [[E], *[[layer(i)] for i in range(6)], [N, H]],
}


@pytest.mark.parametrize("n_stages", sorted(UNIFORM_EXPECTED))
def test_uniform(llama_layout: ModelLayout, n_stages: int) -> None:
    assert split_uniform(llama_layout, n_stages) == UNIFORM_EXPECTED[n_stages]


@pytest.mark.parametrize("weights", [(1, 1), (0, 0), (2, 1), (1, 2), (2, 2)])
def test_uniform_matches_torchtitan(llama_layout: ModelLayout, weights: tuple[int, int]) -> None:
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    iw, ow = weights
    for n in range(1, 9):
        try:
            expected = _generate_llm_fqn_per_model_part(n, 6, input_weight=iw, output_weight=ow)
        except ValueError:
            # torchtitan also refuses a weight above the smallest stage's share; autopp only
            # when the stage holding the weighted modules has too few units (always valid).
            try:
                split = split_uniform(llama_layout, n, input_weight=iw, output_weight=ow)
            except ValueError:
                continue
            assert validate_split(split, llama_layout) == split and len(split) == n
            continue
        assert split_uniform(llama_layout, n, input_weight=iw, output_weight=ow) == expected


def test_uniform_weights_zero(llama_layout: ModelLayout) -> None:
    assert split_uniform(llama_layout, 3, input_weight=0, output_weight=0) == [
        [E, layer(0), layer(1)],
        [layer(2), layer(3)],
        [layer(4), layer(5), N, H],
    ]


def test_uniform_errors(llama_layout: ModelLayout) -> None:
    with pytest.raises(ValueError, match=r"9 stages: more stages than layers.*6 layers"):
        split_uniform(llama_layout, 9)
    with pytest.raises(ValueError, match=r"input_weight 4 is more than stage 0's share of 3"):
        split_uniform(llama_layout, 4, input_weight=4)
    with pytest.raises(ValueError, match=r"output_weight 3 is more than the last stage's"):
        split_uniform(llama_layout, 4, output_weight=3)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n_stages must be an integer >= 1"):
            split_uniform(llama_layout, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_weight must be an integer >= 0"):
        split_uniform(llama_layout, 2, input_weight=-1)


def test_uniform_without_pre_or_post() -> None:
    layout = ModelLayout(pre=(), layers_attr="blocks", layer_names=tuple("0123"), post=())
    assert split_uniform(layout, 2) == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]
    assert split_uniform(layout, 4) == [[f"blocks.{i}"] for i in range(4)]
    with pytest.raises(ValueError, match="5 stages.*4 layers"):
        split_uniform(layout, 5)


# ---------------------------------------------------------------- explicit lists


def test_explicit_normalised(llama_layout: ModelLayout) -> None:
    split = ([layer(1), E, layer(0)], (N, layer(5), layer(2), layer(3), layer(4), H))
    assert validate_split(split, llama_layout) == [
        [E, layer(0), layer(1)],
        [layer(2), layer(3), layer(4), layer(5), N, H],
    ]


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ([], "no stages"),
        ([[E, *map(layer, range(6)), N, H, "layers.6"]], r"'layers.6', which the model does not"),
        ([[E, "layers.0.attention"]], r"inside 'layers.0'"),
        ([[E, layer(0), layer(1)], [layer(1), *map(layer, range(2, 6)), N, H]],
         r"'layers.1' is in stage 0 and in stage 1"),
        ([[E, layer(0), layer(0), *map(layer, range(1, 6)), N, H]],
         r"'layers.0' is twice in stage 0"),
        ([[E, *map(layer, range(6))], [N]], r"in no stage: lm_head"),
        ([[E, *map(layer, range(3))], [], [*map(layer, range(3, 6)), N, H]],
         "stage 1 of 3 is empty"),
        ([[E, layer(0), layer(2)], [layer(1), *map(layer, range(3, 6)), N, H]],
         r"out of order: stage 1 holds 'layers.1'.*'layers.2' of stage 0"),
        ([[*map(layer, range(6)), N, H], [E]], r"out of order: stage 1 holds 'tok_embeddings'"),
    ],
)
def test_explicit_errors(llama_layout: ModelLayout, split: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_split(split, llama_layout)


def test_explicit_type_errors(llama_layout: ModelLayout) -> None:
    with pytest.raises(TypeError, match="stage 0 must be a list of module names, got str"):
        validate_split(["tok_embeddings"], llama_layout)
    with pytest.raises(TypeError, match="list of lists"):
        validate_split("Ett", llama_layout)  # type: ignore[arg-type]


# ---------------------------------------------------------------- layout strings


THREE = [[E, layer(0), layer(1)], [layer(2), layer(3)], [layer(4), layer(5), N, H]]


@pytest.mark.parametrize(
    "spec",
    [
        "Ett|tt|ttL",
        "E(tt|)*2ttL",
        "Et*2|t*2|t*2L",
        " E t t , | t t | t t L ",
        "(E)t*2|((t)*2|)tt(L)",
    ],
)
def test_layout_string(llama_layout: ModelLayout, spec: str) -> None:
    assert parse_layout(spec, llama_layout) == THREE


def test_layout_string_examples(llama_layout: ModelLayout) -> None:
    assert parse_layout("Ettt|tttL", llama_layout) == UNIFORM_EXPECTED[2]
    assert parse_layout("E|(t|)*6L", llama_layout) == UNIFORM_EXPECTED[8]
    assert parse_layout("Et*6L", llama_layout) == UNIFORM_EXPECTED[1]


@pytest.mark.parametrize("n_stages", sorted(UNIFORM_EXPECTED))
def test_format_layout_round_trip(llama_layout: ModelLayout, n_stages: int) -> None:
    split = UNIFORM_EXPECTED[n_stages]
    spec = format_layout(split, llama_layout)
    assert parse_layout(spec, llama_layout) == split
    assert format_layout(THREE, llama_layout) == "Ett|tt|ttL"
    assert format_layout(UNIFORM_EXPECTED[1], llama_layout) == "Et*6L"


def test_format_layout_split_post(llama_layout: ModelLayout) -> None:
    with pytest.raises(ValueError, match="only some of norm, lm_head"):
        format_layout([[E, *map(layer, range(6)), N], [H]], llama_layout)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("Ett|x|ttL", r"unexpected 'x' .* at position 4"),
        ("E(tt|*2ttL", r"'\(' is never closed at position 1"),
        ("Ett)|ttttL", r"unmatched '\)' at position 3"),
        ("Et**2|ttttL", r"expected a count >= 1 after '\*' at position 3"),
        ("*Et|tttttL", r"'\*' has nothing to repeat at position 0"),
        ("Et*0|ttttttL", r"expected a count >= 1 after '\*' at position 3"),
        ("E(tt|)*", r"expected a count >= 1 after '\*' at position 7"),
        ("", "is empty"),
        (" , ", "is empty"),
        ("Ett|tL", r"has 3 layers \('t'\) but the model has 6 layers"),
        ("E(tt|)*3tL", r"has 7 layers \('t'\) but the model has 6"),
        ("E(tt|)*3L", None),
        ("Ett|EttttL", r"has 2 'E'"),
        ("ttt|tttL", r"has no 'E'.*tok_embeddings"),
        ("Ettt|ttt", r"has no 'L'.*norm, lm_head"),
        ("Ettt||tttL", "stage 1 of 3 is empty"),
        ("Ettt|tttL|", "stage 2 of 3 is empty"),
        ("tttL|Ettt", "out of order"),
        ("Ettt|(|)*100000000000tttL", "some stage would be empty"),
    ],
)
def test_layout_string_errors(llama_layout: ModelLayout, spec: str, message: str | None) -> None:
    if message is None:  # valid: a last stage holding only norm + lm_head
        assert parse_layout(spec, llama_layout)[-1] == [N, H]
        return
    with pytest.raises(ValueError, match=message):
        parse_layout(spec, llama_layout)


def test_layout_string_e_without_pre() -> None:
    layout = ModelLayout(pre=(), layers_attr="layers", layer_names=("0", "1"), post=("head",))
    with pytest.raises(ValueError, match="has 'E' but the model has no modules before"):
        parse_layout("Et|tL", layout)
    assert parse_layout("t|tL", layout) == [["layers.0"], ["layers.1", "head"]]


# ---------------------------------------------------------------- resolve_split


def test_resolve_split(llama: nn.Module, llama_layout: ModelLayout) -> None:
    assert resolve_split(llama, None, 2) == UNIFORM_EXPECTED[2]
    assert resolve_split(llama, 4) == UNIFORM_EXPECTED[4]
    assert resolve_split(llama, 4, 4) == UNIFORM_EXPECTED[4]
    assert resolve_split(llama_layout, "Ett|tt|ttL", 3) == THREE
    assert resolve_split(llama, THREE) == THREE
    assert resolve_split(llama, 3, input_weight=0, output_weight=0) == split_uniform(
        llama_layout, 3, input_weight=0, output_weight=0
    )


def test_resolve_split_errors(llama: nn.Module) -> None:
    with pytest.raises(ValueError, match="split asks for 4 stages but n_stages is 2"):
        resolve_split(llama, 4, 2)
    with pytest.raises(ValueError, match="the split has 3 stages but n_stages is 2"):
        resolve_split(llama, "Ett|tt|ttL", 2)
    with pytest.raises(ValueError, match="the split has 3 stages but n_stages is 4"):
        resolve_split(llama, THREE, 4)
    with pytest.raises(ValueError, match="needs n_stages"):
        resolve_split(llama)
    with pytest.raises(TypeError, match="got float"):
        resolve_split(llama, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got a bool"):
        resolve_split(llama, True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- build_stage_module


def param_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters()}


def test_build_llama_stage_fqns(llama: nn.Module) -> None:
    whole = param_names(llama)
    stages = [build_stage_module(llama, fqns) for fqns in THREE]
    names = [param_names(stage) for stage in stages]
    for stage_names, fqns in zip(names, THREE):
        expected = {n for n in whole if any(n.startswith(f + ".") for f in fqns)}
        assert stage_names == expected
    assert set.union(*names) == whole
    assert "layers.3.attention.wo.weight" in names[1]
    assert list(stages[1].layers.keys()) == ["2", "3"]
    assert isinstance(stages[0].norm, Skipped) and isinstance(stages[0].lm_head, Skipped)
    assert isinstance(stages[1].tok_embeddings, Skipped)
    assert isinstance(stages[2].tok_embeddings, Skipped)
    for stage in stages:
        assert all(t.is_meta for t in [*stage.parameters(), *stage.buffers()])
    assert param_names(llama) == whole  # the whole model is untouched
    assert len(llama.layers) == 6


def test_build_copies_what_it_keeps_and_nothing_else() -> None:
    model = toy_meta()
    stage = build_stage_module(model, ["layers.1", "layers.2"])
    kept = {id(m) for m in stage.modules()}
    assert not kept & {id(m) for m in model.modules()}  # no module shared with the model
    # a dropped unit that a kept layer also holds is copied too, not shared
    model.head = nn.Tanh()
    model.layers[2].append(model.head)  # the head object, inside layer 2 as well
    stage = build_stage_module(model, ["layers.1", "layers.2"])
    # a parameterless module outside the layers is no stage's: every stage keeps a copy
    assert not isinstance(stage.head, Skipped) and stage.head is not model.head
    assert stage.layers[2][2] is not model.head
    assert not {id(m) for m in stage.modules()} & {id(m) for m in model.modules()}


def test_build_module_list() -> None:
    model = toy_meta()
    stage = build_stage_module(model, ["layers.1", "layers.2"])
    assert isinstance(stage.layers, StageLayers)
    assert param_names(stage) == {f"layers.{i}.0.{p}" for i in (1, 2) for p in ("weight", "bias")}
    assert [m is stage.layers["1"] for m in stage.layers] == [True, False]
    assert stage.layers[2] is stage.layers["2"]
    with pytest.raises(IndexError, match="does not hold layer 0"):
        stage.layers[0]
    whole_stage = build_stage_module(model, ["embed", *map(layer, range(4)), "head"])
    assert isinstance(whole_stage.layers, nn.ModuleList)


def test_build_errors(llama: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"not contiguous.*'layers.0' and 'layers.2' but not"):
        build_stage_module(llama, ["layers.0", "layers.2"])
    with pytest.raises(ValueError, match="'layers.9', which the model does not have"):
        build_stage_module(llama, ["layers.9"])
    with pytest.raises(ValueError, match="stage is empty"):
        build_stage_module(llama, [])
    with pytest.raises(ValueError, match="'norm' is twice"):
        build_stage_module(llama, ["norm", "norm"])


def test_build_tied_weights() -> None:
    model = toy_meta()
    model.head.weight = model.embed.weight
    with pytest.raises(ValueError, match="shared \\(tied\\) between embed in the stage and head"):
        build_stage_module(model, ["embed", "layers.0"])
    with pytest.raises(ValueError, match="between head in the stage and embed outside"):
        build_stage_module(model, ["layers.3", "head"])


def test_build_8b_stays_on_meta_and_fast() -> None:
    model = llama3_meta("8B")
    split = resolve_split(model, 4)
    start = time.perf_counter()
    stage = build_stage_module(model, split[1])
    elapsed = time.perf_counter() - start
    assert all(p.is_meta for p in stage.parameters())
    assert list(stage.layers.keys()) == [str(i) for i in range(8, 17)]
    assert elapsed < 2.0, f"building an 8B stage on meta took {elapsed:.2f} s"


# ---------------------------------------------------------------- stage forwards = whole forward


def materialise_llama(module: nn.Module) -> nn.Module:
    module.to_empty(device="cpu")
    module.init_states(buffer_device=torch.device("cpu"))
    return module


def load_from_whole(stage: nn.Module, whole: nn.Module) -> None:
    result = stage.load_state_dict(whole.state_dict(), strict=False)
    assert result.missing_keys == []


def test_llama_stage_chain_matches_whole() -> None:
    meta = llama3_meta(max_seq_len=64)
    stage_modules = [build_stage_module(meta, fqns) for fqns in resolve_split(meta, 2)]
    torch.manual_seed(0)
    whole = materialise_llama(meta)  # in place: the stages were copied before
    for stage in stage_modules:
        materialise_llama(stage)
        load_from_whole(stage, whole)
    tokens = torch.randint(0, 2048, (2, 16))
    with torch.no_grad():
        expected = whole(tokens)
        hidden = stage_modules[0](tokens)
        got = stage_modules[1](hidden)
    assert hidden.shape == (2, 16, 256)
    torch.testing.assert_close(got, expected)


def assert_chain_matches_whole(meta: nn.Module, whole_cls: type, spec: str) -> None:
    """The stages of ``spec``, materialised with the weights of a fresh ``whole_cls()``,
    chained on a batch, give that whole model's output."""
    split = parse_layout(spec, inspect_model(meta))
    stage_modules = [build_stage_module(meta, fqns) for fqns in split]
    torch.manual_seed(0)
    whole = whole_cls()
    for stage in stage_modules:
        stage.to_empty(device="cpu")
        load_from_whole(stage, whole)
    x = torch.randint(0, 32, (3, 5))
    with torch.no_grad():
        h = x
        for stage in stage_modules:
            h = stage(h)
        torch.testing.assert_close(h, whole(x))


def test_module_list_stage_chain_matches_whole() -> None:
    assert_chain_matches_whole(toy_meta(), Toy, "Et|tt|tL")


def test_placement_conflicts_name_each_tied_parameter_and_its_ranks():
    from autopp.tied import placement_conflicts

    same = [{"tok_embeddings.weight": "(Shard(dim=0),)"}] * 4
    assert placement_conflicts(same) == []
    per_rank = [{"tok_embeddings.weight": "(Shard(dim=0),)"}, {},
                {"tok_embeddings.weight": "(Shard(dim=1),)"},
                {"tok_embeddings.weight": "(Shard(dim=0),)"}]
    assert placement_conflicts(per_rank) == [
        "tok_embeddings.weight: (Shard(dim=0),) on ranks [0, 3], (Shard(dim=1),) on ranks [2]"]


class _TableBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h) + table)


class _Unskipping(nn.Module):
    """A forward that calls every module unconditionally and computes between them, as
    Hugging Face's do: a scale on the embeddings (Gemma), a table from the input's shape
    handed to every layer (RoPE), a final tanh cap on the logits."""

    def __init__(self, vocab: int = 32, dim: int = 8, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_TableBlock(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.n_layers = n_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * 3.0
        table = torch.arange(h.shape[1], dtype=torch.float32)[:, None] / 10
        for layer in self.layers[: self.n_layers]:  # as transformers' config.num_hidden_layers
            h = layer(h, table)
        return torch.tanh(self.head(self.norm(h)) / 5) * 5


@pytest.mark.parametrize("spec", ["Et|tt|tL", "Ettt|tL", "E|tttt|L"])
def test_forward_calling_removed_modules_is_cut_at_the_stage(spec: str) -> None:
    """Each stage runs the whole model's forward cut at its boundaries: the received
    activation replaces what the forward computed before the stage's first module (the
    embedding scale is not applied twice), the last module's output is what a non-last
    stage sends (the tanh cap is not applied to activations); chained, the stages compute
    the whole model's output."""
    with torch.device("meta"):
        meta = _Unskipping()
    assert_chain_matches_whole(meta, _Unskipping, spec)
