"""Building one pipeline stage's module from the whole model, without materialising it.

The stage module is a copy of the whole model (``copy.deepcopy`` of what the stage keeps; on the
meta device this copies no data) with everything the stage does not hold removed:

- pre/post modules not in the stage are set to ``None``, at whatever depth they are (the
  model's forward must skip ``None`` modules, as torchtitan's ``Decoder.forward`` does for
  ``tok_embeddings``, ``norm`` and ``lm_head``);
- layers not in the stage are deleted from the layers container. A ``ModuleDict`` keeps its
  remaining keys. A ``ModuleList`` is replaced by a :class:`StageLayers`, a ``ModuleDict`` keyed
  by the original indices that iterates over its modules like a list, so that ``for layer in
  self.layers`` still works and parameter names stay those of the whole model.

Parameter and buffer FQNs of the stage module are exactly the whole model's
(``layers.3.attention.wo.weight`` stays ``layers.3.attention.wo.weight``), so a checkpoint of the
whole model loads into a stage by name with ``load_state_dict(..., strict=False)``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

from torch import nn

from autopp.stage_split.layout import ModelLayout, inspect_model, unit_of
from autopp.stage_split.validate import validate_stage

__all__ = ["LAYERS_ATTR", "StageLayers", "build_stage_module"]


class StageLayers(nn.ModuleDict):
    """The layers one stage keeps from a whole model's ``nn.ModuleList``.

    Keyed by the layers' indices in the whole model (``"3"``, ``"4"``), so parameter names do
    not change. Behaves like the list it replaces where it can: iterating yields the modules in
    order and ``layers[3]`` is the whole model's layer 3 (an ``IndexError`` if this stage does
    not hold it). ``keys()``, ``values()`` and ``items()`` work as for any ``ModuleDict``.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self._modules.values())

    def __getitem__(self, key: int | str) -> nn.Module:
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
        model: the whole model, normally on the meta device; it is not modified.
        fqns: the stage's modules, e.g. ``["layers.2", "layers.3", "norm", "lm_head"]``: one
            contiguous run of pre modules, layers (``"<layers_attr>.<key>"``) and post modules.
        layers_attr: path of the ModuleList/ModuleDict holding the layers (``"layers"``,
            ``"model.layers"``); None finds it (:func:`~autopp.stage_split.layout.find_layers`).
        allow_tied: keep parameters tied between a module of the stage and one outside it
            (the pipeline then keeps their copies equal, see :mod:`autopp.tied`); without it
            such a parameter raises.

    Returns:
        The stage module, on the same device as ``model``, running ``model``'s own forward.

    Raises:
        ValueError: an FQN the model does not have, a module named twice, an empty or
            non-contiguous stage, or a parameter shared (tied) between a module of the stage
            and one outside it.
    """
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
    for name in (*layout.pre, *layout.post):
        if name not in kept:
            _set_submodule(stage, name, None)
    container = stage.get_submodule(layout.layers_attr)
    kept_layers = [
        name for name, fqn in zip(layout.layer_names, layout.layer_fqns) if fqn in kept
    ]
    if len(kept_layers) == layout.n_layers:
        return stage
    if isinstance(container, nn.ModuleDict):
        for name in layout.layer_names:
            if name not in kept_layers:
                del container[name]
    else:
        kept_modules = {name: container[int(name)] for name in kept_layers}
        _set_submodule(stage, layout.layers_attr, StageLayers(kept_modules))
    return stage


#: Attribute of a stage module naming the path of its layers container (set by
#: :func:`build_stage_module`; read by the planner, which plans those layers block by block).
LAYERS_ATTR = "_autopp_layers_attr"


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
