"""The shape of a model as the stage split sees it: modules before the layers, the layers, after.

A model can be split into pipeline stages when its body is a sequence of blocks held in one
``nn.ModuleList`` or ``nn.ModuleDict`` child (``layers`` by default), with top-level modules
before it (the "pre" modules, e.g. ``tok_embeddings``) and after it (the "post" modules, e.g.
``norm`` and ``lm_head``). Pre and post are told apart by registration order: children
registered before the layers container are pre, those registered after it are post. The split
assumes that order is also the order in which the model's forward uses them.

Every split is expressed in module FQNs of the whole model: a pre or post module's child name
(``"norm"``), or ``"<layers_attr>.<key>"`` for one layer (``"layers.3"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["ModelLayout", "inspect_model"]


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Which top-level modules a model has, in forward order, for splitting it into stages."""

    pre: tuple[str, ...]
    """Names of the top-level modules registered before the layers container (embeddings)."""
    layers_attr: str
    """Name of the top-level ``nn.ModuleList``/``nn.ModuleDict`` that holds the layers."""
    layer_names: tuple[str, ...]
    """Keys of the layers in order: ModuleDict keys, or ModuleList indices as strings."""
    post: tuple[str, ...]
    """Names of the top-level modules registered after the layers container (norm, head)."""

    @property
    def n_layers(self) -> int:
        """Number of layers in the layers container."""
        return len(self.layer_names)

    @property
    def layer_fqns(self) -> tuple[str, ...]:
        """FQN of each layer in order, e.g. ``("layers.0", "layers.1", ...)``."""
        return tuple(f"{self.layers_attr}.{name}" for name in self.layer_names)

    @property
    def fqns(self) -> tuple[str, ...]:
        """Every unit a stage can hold, in forward order: pre modules, layers, post modules."""
        return self.pre + self.layer_fqns + self.post

    def describe(self) -> str:
        """Short human-readable list of the units, for error messages.

        E.g. ``"tok_embeddings, layers.0 .. layers.5, norm, lm_head"``.
        """
        layers = self.layer_fqns
        if len(layers) > 3:
            layer_text = [f"{layers[0]} .. {layers[-1]}"]
        else:
            layer_text = list(layers)
        return ", ".join([*self.pre, *layer_text, *self.post])


def inspect_model(model: nn.Module, layers_attr: str = "layers") -> ModelLayout:
    """Find the pre modules, layers and post modules of ``model``.

    Args:
        model: the whole model, usually on the meta device (nothing is materialised).
        layers_attr: name of the top-level child that holds the layers as an
            ``nn.ModuleList`` or ``nn.ModuleDict``.

    Raises:
        ValueError: ``model`` has no such child, the child is not a ModuleList/ModuleDict, it
            holds no layers, or the model has parameters directly on its root module (no stage
            could own them).
    """
    children = dict(model.named_children())
    if layers_attr not in children:
        raise ValueError(
            f"{type(model).__name__} has no top-level module {layers_attr!r} holding its layers; "
            f"its top-level modules are {list(children)}. Pass layers_attr= the name of the "
            "nn.ModuleList or nn.ModuleDict that holds the blocks."
        )
    container = children[layers_attr]
    if isinstance(container, nn.ModuleDict):
        layer_names = tuple(container.keys())
    elif isinstance(container, nn.ModuleList):
        layer_names = tuple(str(i) for i in range(len(container)))
    else:
        raise ValueError(
            f"{type(model).__name__}.{layers_attr} is a {type(container).__name__}; the stage "
            "split needs an nn.ModuleList or nn.ModuleDict of layers"
        )
    if not layer_names:
        raise ValueError(f"{type(model).__name__}.{layers_attr} holds no layers")
    root_params = [name for name, _ in model.named_parameters(recurse=False)]
    if root_params:
        raise ValueError(
            f"{type(model).__name__} has parameters directly on its root module ({root_params}); "
            "no pipeline stage could own them. Move them into a submodule."
        )
    names = list(children)
    at = names.index(layers_attr)
    return ModelLayout(
        pre=tuple(names[:at]),
        layers_attr=layers_attr,
        layer_names=layer_names,
        post=tuple(names[at + 1 :]),
    )
