"""This rank's stage modules seen as one module with whole-model names.

A pipeline rank may hold several stages (interleaved and V schedules). Optimizers, state dicts
and torch.distributed.checkpoint want one module whose parameter names are the whole model's
FQNs; :func:`merge_stage_modules` builds that view without copying anything: its children are
the stages' own modules (the layers of all local stages under one container).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from autopp.stage_split.build import LAYERS_ATTR, Skipped

__all__ = ["merge_stage_modules", "replay_state_dict_hooks"]


class RankModules(nn.Module):
    """A container whose named parameters are this rank's, under whole-model FQNs.

    Not callable: the stages run separately under the pipeline schedule.
    """

    def forward(self, *args, **kwargs):  # pragma: no cover - a view, never run
        raise RuntimeError("RankModules is a view of this rank's stages for state dicts; it does not run")


def merge_stage_modules(
    modules: Sequence[nn.Module], *, layers_attr: str | None = None
) -> nn.Module:
    """One module holding the (disjoint) modules of ``modules`` under their whole-model names.

    Args:
        modules: this rank's stage modules, as built by :func:`build_stage_module` (and
            possibly parallelized); a module held by two stages raises ValueError.
        layers_attr: path of the layers container; None reads it off the stage modules
            (:func:`build_stage_module` records it), else ``"layers"``.
    """
    merged = RankModules()
    for stage in modules:
        path = layers_attr or getattr(stage, LAYERS_ATTR, "layers")
        for fqn, child in _held_units(stage, path):
            *owner_path, leaf = fqn.split(".")
            owner = merged
            for part in owner_path:
                if part not in owner._modules:
                    owner.add_module(part, nn.ModuleDict() if part == owner_path[-1] else nn.Module())
                owner = owner._modules[part]
            if leaf in owner._modules:
                if next(child.parameters(), None) is None:
                    continue  # parameterless (every stage's copy, e.g. a RoPE table): once
                raise ValueError(f"module {fqn!r} is held by two local stages")
            owner.add_module(leaf, child)
    return merged


def _held_units(stage: nn.Module, layers_attr: str) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of each split unit ``stage`` holds: its layers, and the modules beside
    the layers container and beside each module enclosing it."""
    parts = layers_attr.split(".")
    out = []
    for depth in range(len(parts)):
        owner_path = ".".join(parts[:depth])
        owner = stage.get_submodule(owner_path) if owner_path else stage
        prefix = f"{owner_path}." if owner_path else ""
        for name, child in owner.named_children():
            if child is not None and name != parts[depth] and not isinstance(child, Skipped):
                out.append((prefix + name, child))
    container = stage.get_submodule(layers_attr)
    out += [(f"{layers_attr}.{k}", c) for k, c in container.named_children()
            if not isinstance(c, Skipped)]
    return out


def replay_state_dict_hooks(view: nn.Module, modules: Sequence[nn.Module]) -> None:
    """Give ``view`` (a module tree of this rank's parameters under whole-model FQNs that is
    not made of the stage modules themselves, e.g. planned parameters) the state-dict hooks
    the stage ``modules`` (on meta is fine) have at the same FQNs, replayed with the right
    prefix: torchtitan's fused QKV is then saved as ``wq``/``wk``/``wv`` and loaded back, as
    with any other backend. Uses torch's ``_state_dict_hooks`` and
    ``_load_state_dict_pre_hooks`` (no public accessor)."""
    hooked = [(fqn, m) for stage in modules for fqn, m in stage.named_modules()
              if fqn and (m._state_dict_hooks or m._load_state_dict_pre_hooks)]
    if not hooked:
        return

    def post(module, state_dict, prefix, local_metadata):
        for fqn, original in hooked:
            for hook in list(original._state_dict_hooks.values()):
                hook(original, state_dict, f"{prefix}{fqn}.", local_metadata)

    def pre(module, state_dict, prefix, *args):
        for fqn, original in hooked:
            for hook in list(original._load_state_dict_pre_hooks.values()):
                hook(state_dict, f"{prefix}{fqn}.", *args)

    view.register_state_dict_post_hook(post)
    view.register_load_state_dict_pre_hook(pre)
