"""The shape of a model as the stage split sees it: modules before the layers, the layers, after.

The body is a sequence of blocks in one ``nn.ModuleList`` or ``nn.ModuleDict`` (found
automatically, or named by ``layers_attr``). Pre and post modules are told apart by
registration order, at the container's level and every level above it: siblings registered
before are pre, after are post. The split assumes that is also the order the forward uses
them. Modules there holding no parameters (a ``rotary_emb``, a dropout) are no stage's:
every stage keeps a copy. Every split is written in whole-model FQNs: a pre or post module's
(``"norm"``) or ``"<layers_attr>.<key>"`` for one layer (``"model.layers.3"``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["ModelLayout", "find_layers", "inspect_model"]


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Which top-level modules a model has, in forward order, for splitting it into stages."""

    pre: tuple[str, ...]
    """FQNs of the modules registered before the layers container (embeddings), at its level
    and at every level above it, outermost first."""
    layers_attr: str
    """Path of the ``nn.ModuleList``/``nn.ModuleDict`` that holds the layers (``"layers"``,
    ``"model.layers"``)."""
    layer_names: tuple[str, ...]
    """Keys of the layers in order: ModuleDict keys, or ModuleList indices as strings."""
    post: tuple[str, ...]
    """FQNs of the modules registered after the layers container (norm, head), innermost
    first (``model.norm`` before ``lm_head``)."""

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


def inspect_model(model: nn.Module, layers_attr: str | None = None) -> ModelLayout:
    """Find the pre modules, layers and post modules of ``model``.

    Args:
        model: the whole model, usually on the meta device (nothing is materialised).
        layers_attr: path of the ``nn.ModuleList`` or ``nn.ModuleDict`` that holds the layers,
            e.g. ``"layers"`` (torchtitan) or ``"model.layers"`` (Hugging Face style, nested).
            None: found automatically (:func:`find_layers`).

    Raises:
        ValueError: ``model`` has no such module, it is not a ModuleList/ModuleDict, it holds
            no layers, or the model has parameters directly on the root or on a module that
            encloses the layers (no stage could own them).
    """
    if layers_attr is None:
        layers_attr = find_layers(model)
    try:
        container = model.get_submodule(layers_attr)
    except AttributeError:
        raise ValueError(
            f"{type(model).__name__} has no module {layers_attr!r} holding its layers; its "
            f"modules are {_module_list(model)}. Pass layers_attr= the path of the "
            "nn.ModuleList or nn.ModuleDict that holds the blocks (e.g. 'model.layers'), or "
            "None to find it automatically."
        ) from None
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
    pre: list[str] = []
    post: list[str] = []
    parts = layers_attr.split(".")
    for depth in range(len(parts)):
        owner_path = ".".join(parts[:depth])
        owner = model.get_submodule(owner_path) if owner_path else model
        own = [name for name, _ in owner.named_parameters(recurse=False)]
        if own:
            where = f"{type(owner).__name__} ({owner_path or 'the root module'})"
            raise ValueError(
                f"{where} has parameters directly on it ({own}) and encloses the layers; no "
                "pipeline stage could own them. Move them into a submodule."
            )
        names = [n for n, c in owner.named_children()
                 if c is not None and (n == parts[depth] or _holds_parameters(c))]
        at = names.index(parts[depth])
        prefix = f"{owner_path}." if owner_path else ""
        pre += [prefix + n for n in names[:at]]
        post[:0] = [prefix + n for n in names[at + 1 :]]
    return ModelLayout(
        pre=tuple(pre), layers_attr=layers_attr, layer_names=layer_names, post=tuple(post)
    )


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_layers(model: nn.Module) -> str:
    """Path of the module that holds ``model``'s repeated blocks.

    The ``nn.ModuleList`` / ``nn.ModuleDict`` whose children hold the most parameters, among
    those with at least two children of one type (ties: the shallowest). Raises ValueError
    naming the candidates when there is none.
    """
    best: tuple[int, int, str] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)) or not path:
            continue
        children = [c for c in mod.children() if c is not None]
        types = [type(c) for c in children]
        if len(children) < 2 or max(types.count(t) for t in types) < 2:
            continue
        numel = sum(p.numel() for p in mod.parameters())
        key = (numel, -path.count("."), path)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict of repeated blocks "
            f"to split into pipeline stages; its modules are {_module_list(model)}. Hold the "
            "blocks in one, or pass layers_attr= its path."
        )
    return best[2]


def _module_list(model: nn.Module, limit: int = 12) -> list[str]:
    names = [n for n, _ in model.named_modules() if n and n.count(".") < 2]
    return names[:limit] + (["..."] if len(names) > limit else [])


def unit_of(fqn: str, layout: ModelLayout) -> str:
    """The split unit (a pre/post module FQN or ``<layers_attr>.<key>``) that holds the
    parameter or module ``fqn``; ValueError when none does."""
    if fqn.startswith(layout.layers_attr + "."):
        key = fqn[len(layout.layers_attr) + 1 :].partition(".")[0]
        return f"{layout.layers_attr}.{key}"
    for unit in (*layout.pre, *layout.post):
        if fqn == unit or fqn.startswith(unit + "."):
            return unit
    raise ValueError(f"{fqn} belongs to no unit of the split ({layout.describe()})")
