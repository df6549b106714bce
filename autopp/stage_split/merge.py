"""This rank's stage modules seen as one module with whole-model names.

A pipeline rank may hold several stages (interleaved and V schedules). Optimizers, state dicts
and torch.distributed.checkpoint want one module whose parameter names are the whole model's
FQNs; :func:`merge_stage_modules` builds that view without copying anything: its children are
the stages' own modules (the layers of all local stages under one container).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["merge_stage_modules"]


class RankModules(nn.Module):
    """A container whose named parameters are this rank's, under whole-model FQNs.

    Not callable: the stages run separately under the pipeline schedule.
    """

    def forward(self, *args, **kwargs):  # pragma: no cover - a view, never run
        raise RuntimeError("RankModules is a view of this rank's stages for state dicts; it does not run")


def merge_stage_modules(modules: Sequence[nn.Module], *, layers_attr: str = "layers") -> nn.Module:
    """One module holding the (disjoint) modules of ``modules`` under their whole-model names.

    Args:
        modules: this rank's stage modules, as built by :func:`build_stage_module` (and
            possibly parallelized); a module name held by two stages raises ValueError.
        layers_attr: the name of the layers container.
    """
    merged = RankModules()
    layers = nn.ModuleDict()
    for stage in modules:
        for name, child in stage.named_children():
            if child is None:
                continue
            if name == layers_attr:
                for key, layer in child.named_children():
                    if key in layers:
                        raise ValueError(f"layer {layers_attr}.{key} is held by two local stages")
                    layers[key] = layer
            elif name in merged._modules:
                raise ValueError(f"module {name!r} is held by two local stages")
            else:
                merged.add_module(name, child)
    if len(layers):
        merged.add_module(layers_attr, layers)
    return merged
