"""One entry point for every way of stating a split: ``resolve_split``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from autopp.stage_split.layout import ModelLayout, inspect_model
from autopp.stage_split.layout_string import parse_layout
from autopp.stage_split.uniform import split_uniform
from autopp.stage_split.validate import validate_split

__all__ = ["SplitSpec", "resolve_split"]

SplitSpec = int | str | Sequence[Sequence[str]] | None
"""How a user states a split: None or a stage count (uniform), a layout string, or FQN lists."""


def resolve_split(
    model: nn.Module | ModelLayout,
    split: SplitSpec = None,
    n_stages: int | None = None,
    *,
    layers_attr: str | None = None,
    input_weight: int = 1,
    output_weight: int = 1,
) -> list[list[str]]:
    """Turn any supported statement of a split into a validated ``list[list[str]]`` of FQNs.

    Args:
        model: the whole model (meta is fine) or its :class:`ModelLayout`.
        split: None or an ``int`` for a uniform split; a layout string (``"Ett|tt|ttL"``,
            :mod:`autopp.stage_split.layout_string`); or module FQNs per stage.
        n_stages: the stages the caller needs; checked when given, required when ``split`` is
            None.
        layers_attr: path of the layers container; None finds it (ignored for a layout).
        input_weight, output_weight: weights of the pre/post modules in a uniform split.

    Returns each stage's module FQNs in model order. Raises ValueError for an invalid split, a
    stage count other than ``n_stages`` (naming both) or a missing ``n_stages``; TypeError for an
    unsupported ``split``."""
    layout = model if isinstance(model, ModelLayout) else inspect_model(model, layers_attr)
    if split is None:
        if n_stages is None:
            raise ValueError("split=None (uniform) needs n_stages")
        return split_uniform(
            layout, n_stages, input_weight=input_weight, output_weight=output_weight
        )
    if isinstance(split, bool):
        raise TypeError("split must be None, an int, a layout string or FQN lists, got a bool")
    if isinstance(split, int):
        if n_stages is not None and split != n_stages:
            raise ValueError(f"split asks for {split} stages but n_stages is {n_stages}")
        stages = split_uniform(
            layout, split, input_weight=input_weight, output_weight=output_weight
        )
    elif isinstance(split, str):
        stages = parse_layout(split, layout)
    elif isinstance(split, Sequence):
        stages = validate_split(split, layout)
    else:
        raise TypeError(
            "split must be None, an int, a layout string or FQN lists per stage, "
            f"got {type(split).__name__}"
        )
    if n_stages is not None and len(stages) != n_stages:
        raise ValueError(f"the split has {len(stages)} stages but n_stages is {n_stages}")
    return stages
