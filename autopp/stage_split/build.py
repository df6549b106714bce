"""Building one pipeline stage's module from the whole model, without materialising it.

The stage module is a deep copy (free on meta) of what the stage keeps, running the whole
model's own forward unchanged, cut at the stage's boundaries. Pre/post modules it does not
hold become :class:`Skipped` stand-ins returning their first input (so forwards that call
them run); layers it does not hold are deleted, a ``ModuleList`` becoming a
:class:`StageLayers` keyed by the original indices that iterates and slices like the list.
The cut (:class:`StageCut`, forward hooks) feeds a later stage's received activation to its
first module and returns a stage's last module's output, so the forward's glue (a RoPE table,
a mask from the input's shape) still runs and its tail does not touch activations. A stage
whose forward reads its input also takes the model's inputs as keywords (:data:`MODEL_INPUT`,
:mod:`autopp.stage_split.model_inputs`).

Invariant: parameter and buffer FQNs are the whole model's, so state dicts, init seeds and
checkpoints need no renaming."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autopp.stage_split.layout import ModelLayout, inspect_model, unit_of
from autopp.stage_split.validate import validate_stage

__all__ = ["LAYERS_ATTR", "MODEL_INPUT", "Skipped", "StageCut", "StageLayers",
           "build_stage_module", "is_model_input", "model_input_keywords"]

#: Prefix of the keywords that carry the model's positional inputs to a stage
#: (``autopp_input_0`` is the model's first input, e.g. its token ids).
MODEL_INPUT = "autopp_input_"


def model_input_keywords(inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's positional inputs as the keywords a stage takes them by, in order."""
    return {f"{MODEL_INPUT}{i}": t for i, t in enumerate(inputs)}


def is_model_input(name: str) -> bool:
    """Whether keyword ``name`` carries one of the model's positional inputs."""
    return name.startswith(MODEL_INPUT) and name[len(MODEL_INPUT):].isdigit()


class StageLayers(nn.ModuleDict):
    """The layers one stage keeps from a whole model's ``nn.ModuleList``.

    Keyed by the layers' indices in the whole model (``"3"``, ``"4"``), so parameter names do
    not change. Behaves like the list it replaces where it can: iterating yields the modules in
    order and ``layers[3]`` is the whole model's layer 3 (an ``IndexError`` if this stage does
    not hold it). ``keys()``, ``values()`` and ``items()`` work as for any ``ModuleDict``; a
    slice (``layers[:n]``, as Hugging Face's forwards take) gives the held layers among those
    the whole list's slice would.
    """

    def __init__(self, modules: Mapping[str, nn.Module], total: int):
        super().__init__(modules)
        self._autopp_total = total

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self._modules.values())

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, slice):  # the held layers among the whole list's [key], in order
            return [self._modules[str(i)] for i in range(self._autopp_total)[key]
                    if str(i) in self._modules]
        if isinstance(key, int) and not isinstance(key, bool):
            if str(key) not in self._modules:
                raise IndexError(f"this stage does not hold layer {key}; it holds {list(self)}")
            key = str(key)
        return super().__getitem__(key)


def build_stage_module(
    model: nn.Module, fqns: Sequence[str], *, layers_attr: str | None = None,
    allow_tied: bool = False,
) -> nn.Module:
    """Return a copy of ``model`` that holds only the modules in ``fqns``.

    Args:
        model: the whole model, normally on meta; not modified.
        fqns: one contiguous run of pre modules, layers (``"<layers_attr>.<key>"``) and post
            modules.
        layers_attr: path of the layers container; None finds it.
        allow_tied: keep parameters tied to a module outside the stage (the pipeline keeps the
            copies equal, :mod:`autopp.tied`); without it such a parameter raises.

    Returns the stage module on ``model``'s device, running ``model``'s own forward. Raises
    ValueError for an unknown FQN, a module named twice, an empty or non-contiguous stage, or an
    untolerated tie."""
    layout = inspect_model(model, layers_attr)
    kept = set(validate_stage(fqns, layout))
    if not allow_tied:
        _check_no_shared_parameters(model, layout, kept)
    # modules the stage drops are not copied (the memo maps them to themselves) and are
    # removed from the copy below; a dropped module that a kept one also holds would stay
    # shared with the original, so then the whole model is copied
    container = model.get_submodule(layout.layers_attr)
    dropped = [model.get_submodule(n) for n in (*layout.pre, *layout.post) if n not in kept]
    dropped += [container[int(n)] if isinstance(container, nn.ModuleList) else container[n]
                for n, fqn in zip(layout.layer_names, layout.layer_fqns) if fqn not in kept]
    dropped_ids = {id(m) for m in dropped if m is not None}
    kept_modules = [m for name in kept for m in model.get_submodule(name).modules()]
    shared = any(id(m) in dropped_ids for m in kept_modules)
    memo = {} if shared else {id(m): m for m in dropped if m is not None}
    stage = copy.deepcopy(model, memo=memo)
    object.__setattr__(stage, LAYERS_ATTR, layout.layers_attr)
    skipped_before: list[Skipped] = []  # stand-ins of modules before the stage's own
    for name in (*layout.pre, *layout.post):
        if name not in kept:
            _set_submodule(stage, name, Skipped(name))
            if name in layout.pre:
                skipped_before.append(stage.get_submodule(name))
    container = stage.get_submodule(layout.layers_attr)
    kept_layers = [
        name for name, fqn in zip(layout.layer_names, layout.layer_fqns) if fqn in kept
    ]
    ordered = [f for f in layout.fqns if f in kept]
    first, last = ordered[0], ordered[-1]
    # a stage without layers is cut at a layer's slot, a Skipped stand-in: before the first
    # layer when it holds modules before them (it sends what that layer would receive),
    # after the last when it holds modules after them (what it receives replaces that)
    slot = None
    if not kept_layers:
        slot = layout.layer_names[0] if last in layout.pre else layout.layer_names[-1]
        if last in layout.pre:
            last = f"{layout.layers_attr}.{slot}"
        else:
            first = f"{layout.layers_attr}.{slot}"
    if len(kept_layers) < layout.n_layers:
        if isinstance(container, nn.ModuleDict):
            for name in layout.layer_names:
                if name not in kept_layers:
                    del container[name]
        else:
            kept_modules = {name: container[int(name)] for name in kept_layers}
            container = StageLayers(kept_modules, layout.n_layers)
            _set_submodule(stage, layout.layers_attr, container)
        if slot is not None:
            container[slot] = Skipped(f"{layout.layers_attr}.{slot}")
    receives = ordered[0] != layout.fqns[0]
    cut = StageCut.install(stage, first=first, last=last, receives=receives,
                           sends=ordered[-1] != layout.fqns[-1])
    if receives:  # pre modules held elsewhere all come before this stage's first module
        for skipped in skipped_before:
            object.__setattr__(skipped, CUT_ATTR, cut)
    if cut.sends:  # a module of the stage that the forward calls after its end is lost
        blocks = set(layout.layer_fqns)  # called in order by the blocks' loop: not hooked,
        for fqn in ordered:              # so they stay plain units the planner traces once
            if fqn != last and fqn not in blocks:
                stage.get_submodule(fqn).register_forward_pre_hook(
                    functools.partial(cut._before_held, fqn))
    return stage


class Skipped(nn.Module):
    """Stands in a stage for a module that another stage holds: it holds nothing and returns
    its first input, so the model's forward runs unchanged (the cut, :class:`StageCut`,
    decides what reaches the stage's own modules). Before a receiving stage's first module,
    while the stage runs, it returns the received activation instead: what the modules it
    stands for computed."""

    def __init__(self, fqn: str):
        super().__init__()
        self.fqn = fqn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cut = getattr(self, CUT_ATTR, None)
        if cut is not None and cut.active:
            return cut.received
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        raise TypeError(f"{self.fqn} (held by another stage) was called without inputs")

    def extra_repr(self) -> str:
        return f"held by another stage: {self.fqn}"


class StageCut:
    """Where a stage module's forward starts and ends in the whole model's forward.

    Installed by :func:`build_stage_module` as forward hooks, active only while the stage
    module itself is called (a unit called alone, as the planner calls its blocks, is not
    cut): with ``receives``, the activation the stage is called with replaces the first
    input of its first module ``first``; with ``sends``, the stage returns its last module's
    (``last``) output, whatever the forward does after it. A mapping output (transformers'
    ``ModelOutput``) becomes its one tensor value. Called with the model's inputs as
    keywords (:data:`MODEL_INPUT`), a receiving stage runs the forward on them (the
    activation stays its first positional input); every stage drops those keywords.
    """

    def __init__(self, first: str, last: str, receives: bool, sends: bool):
        self.first, self.last, self.receives, self.sends = first, last, receives, sends
        self.active = False
        self.received: Any = None
        self.sent: Any = None
        self.fed = False

    @classmethod
    def install(cls, stage: nn.Module, *, first: str, last: str, receives: bool,
                sends: bool) -> StageCut:
        cut = cls(first, last, receives, sends)
        object.__setattr__(stage, CUT_ATTR, cut)
        stage.register_forward_pre_hook(cut._enter, with_kwargs=True)
        stage.register_forward_hook(cut._leave, always_call=True)
        if receives:
            stage.get_submodule(first).register_forward_pre_hook(cut._feed, with_kwargs=True)
        if sends:
            stage.get_submodule(last).register_forward_hook(cut._take)
        return cut

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        self.active, self.sent, self.fed = True, None, False
        inputs = [kwargs[k] for k in sorted((k for k in kwargs if is_model_input(k)),
                                            key=lambda k: int(k[len(MODEL_INPUT):]))]
        if self.receives:
            if not args:
                raise TypeError(f"this stage starts at {self.first} and takes the previous "
                                "stage's activation as its first positional input")
            self.received = args[0]
        if not inputs:
            return None
        kwargs = {k: v for k, v in kwargs.items() if not is_model_input(k)}
        return (tuple(inputs) if self.receives else args), kwargs

    def _feed(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not self.active:
            return None
        if not args:
            raise TypeError(f"{self.first}, where this stage starts, is called without a "
                            "positional input for the previous stage's activation to replace")
        self.fed = True
        return (self.received, *args[1:]), kwargs

    def _before_held(self, fqn: str, module: nn.Module, args: tuple) -> None:
        if self.active and self.sent is not None:
            raise RuntimeError(
                f"the model's forward calls {fqn} after {self.last}, where this stage ends, "
                "so its output would not reach the next stage: a split orders a model's "
                "modules as the model registers them (named_children), and this forward "
                f"calls {fqn} after the blocks while the model registers it before them. "
                "Register the model's modules in the order its forward calls them, or run "
                "it without pipeline stages (pp=1)")

    def _take(self, module: nn.Module, args: tuple, out: Any) -> None:
        if self.active:
            self.sent = out[0] if isinstance(out, tuple) else out

    def _leave(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if not self.active:
            return None
        self.active, self.received = False, None
        if out is None:  # the forward raised (this hook always runs): reset, let it raise
            self.sent = None
            return None
        if self.receives and not self.fed:
            raise RuntimeError(f"the model's forward never called {self.first}, where this "
                               "stage starts")
        if self.sends:
            if self.sent is None:
                raise RuntimeError(f"the model's forward never called {self.last}, where this "
                                   "stage ends")
            out, self.sent = self.sent, None
            return out
        return _one_tensor(out)


def _one_tensor(out: Any) -> Any:
    """A mapping output's one tensor (a ``CausalLMOutputWithPast``'s logits); anything else
    as it is."""
    if not isinstance(out, Mapping):
        return out
    values = [(k, v) for k, v in out.items() if v is not None]
    tensors = [v for _, v in values if isinstance(v, torch.Tensor)]
    if len(tensors) != 1 or len(values) != 1:
        raise ValueError(
            f"the model returns {type(out).__name__} with {[k for k, _ in values]}; a pipeline "
            "stage sends one tensor to the loss (turn off caches and extra outputs, e.g. "
            "use_cache=False, output_hidden_states=False)")
    return tensors[0]


#: Attribute of a stage module naming the path of its layers container (set by
#: :func:`build_stage_module`; read by the planner, which plans those layers block by block).
LAYERS_ATTR = "_autopp_layers_attr"

#: Attribute of a stage module holding its :class:`StageCut`.
CUT_ATTR = "_autopp_cut"


def _set_submodule(root: nn.Module, path: str, value: nn.Module | None) -> None:
    owner_path, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    setattr(owner, leaf, value)


def _check_no_shared_parameters(model: nn.Module, layout: ModelLayout, kept: set[str]) -> None:
    """Raise if a parameter belongs both to a unit in ``kept`` and to one outside it."""
    units_of: dict[int, set[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        units_of.setdefault(id(param), set()).add(_unit_of(fqn, layout))
    for units in units_of.values():
        inside, outside = units & kept, units - kept
        if inside and outside:
            raise ValueError(
                f"a parameter is shared (tied) between {', '.join(sorted(inside))} in the "
                f"stage and {', '.join(sorted(outside))} outside it; pipeline stages cannot "
                "share parameters. Put them in one stage or untie them."
            )


def _unit_of(fqn: str, layout: ModelLayout) -> str:
    """The stage unit (pre/post module FQN or ``<layers_attr>.<key>``) a parameter FQN
    belongs to."""
    return unit_of(fqn, layout)
