"""Checking a split: every module in exactly one stage, no empty stage, stages in model order.

A split is a ``list[list[str]]``: for each pipeline stage, the FQNs of the whole model's
top-level units it holds (see :mod:`autopp.stage_split.layout`), the same format as
torchtitan's ``module_fqns_per_model_part``.

The order rule: stage ``k`` must hold the units that come right after stage ``k - 1``'s in
forward order (pre modules, then layers in order, then post modules). A pipeline passes each
stage's output to the next stage, so anything else would feed a layer the wrong activation.
Together with "every unit in exactly one stage" this means each stage holds one contiguous run
of units. Within one stage the order given does not matter; the result lists it in model order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from autopp.stage_split.layout import ModelLayout
from autopp.stage_split.meta_run import run_on_meta

__all__ = ["validate_split", "validate_stage"]


def validate_split(fqns_per_stage: Sequence[Sequence[str]], layout: ModelLayout) -> list[list[str]]:
    """Check a split against the model and return it normalised (each stage in model order).

    Args:
        fqns_per_stage: for each stage, the module FQNs it holds, e.g.
            ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]``.
        layout: the model's layout, from :func:`autopp.stage_split.inspect_model`.

    Raises:
        ValueError: no stages; an FQN the model does not have; a module in two stages (or twice
            in one) or in none; an empty stage; stages out of model order.
        TypeError: the split is not a list of lists of strings.
    """
    stages = _as_stages(fqns_per_stage)
    if not stages:
        raise ValueError("the split has no stages")
    rank = {fqn: i for i, fqn in enumerate(layout.fqns)}
    owner: dict[str, int] = {}
    for s, stage in enumerate(stages):
        if not stage:
            raise ValueError(f"stage {s} of {len(stages)} is empty; every stage needs a module")
        for fqn in stage:
            if fqn not in rank:
                raise ValueError(_unknown_message(fqn, f"stage {s}", layout))
            if fqn in owner:
                where = "twice in" if owner[fqn] == s else f"in stage {owner[fqn]} and in"
                raise ValueError(f"module {fqn!r} is {where} stage {s}; each goes to one stage")
            owner[fqn] = s
    missing = [fqn for fqn in layout.fqns if fqn not in owner]
    if missing:
        raise ValueError(f"module(s) in no stage: {', '.join(missing)}")
    ordered = [sorted(stage, key=rank.__getitem__) for stage in stages]
    for s in range(1, len(ordered)):
        prev_last, first = ordered[s - 1][-1], ordered[s][0]
        if rank[first] < rank[prev_last]:
            raise ValueError(
                f"stages out of order: stage {s} holds {first!r}, which comes before "
                f"{prev_last!r} of stage {s - 1}; each stage must hold the modules that come "
                "right after the previous stage's, in model order"
            )
    return ordered


def validate_stage(fqns: Sequence[str], layout: ModelLayout) -> list[str]:
    """Check the FQNs of one stage and return them in model order.

    A stage must be non-empty, name only units the model has, none twice, and be one
    contiguous run of units (e.g. ``layers.1, layers.2`` but not ``layers.1, layers.3``).

    Raises:
        ValueError: naming the offending module.
        TypeError: ``fqns`` is not a list of strings.
    """
    (stage,) = _as_stages([fqns])
    if not stage:
        raise ValueError("the stage is empty; name at least one module")
    rank = {fqn: i for i, fqn in enumerate(layout.fqns)}
    seen: set[str] = set()
    for fqn in stage:
        if fqn not in rank:
            raise ValueError(_unknown_message(fqn, "the stage", layout))
        if fqn in seen:
            raise ValueError(f"module {fqn!r} is twice in the stage")
        seen.add(fqn)
    ordered = sorted(stage, key=rank.__getitem__)
    for a, b in zip(ordered, ordered[1:]):
        if rank[b] != rank[a] + 1:
            gap = layout.fqns[rank[a] + 1]
            raise ValueError(
                f"the stage's modules are not contiguous: it holds {a!r} and {b!r} but not "
                f"{gap!r}; a pipeline stage holds one consecutive run of modules"
            )
    return ordered


def _as_stages(fqns_per_stage: object) -> list[list[str]]:
    """Convert to ``list[list[str]]``, rejecting strings where a list is expected."""
    if isinstance(fqns_per_stage, str | bytes) or not isinstance(fqns_per_stage, Sequence):
        raise TypeError(
            f"a split is a list of lists of module names, got {type(fqns_per_stage).__name__}"
        )
    stages = []
    for s, stage in enumerate(fqns_per_stage):
        if isinstance(stage, str | bytes) or not isinstance(stage, Sequence):
            raise TypeError(
                f"stage {s} must be a list of module names, got {type(stage).__name__} "
                f"{stage!r}"
            )
        for fqn in stage:
            if not isinstance(fqn, str):
                raise TypeError(f"stage {s} holds {fqn!r}; module names are strings")
        stages.append(list(stage))
    return stages


def _unknown_message(fqn: str, where: str, layout: ModelLayout) -> str:
    """Error text for an FQN that is not one of the model's units."""
    inside = next((u for u in layout.fqns if fqn.startswith(u + ".")), None)
    hint = (
        f"; it is inside {inside!r}, and stages hold whole layers and top-level modules"
        if inside is not None
        else ""
    )
    return (
        f"{where} names {fqn!r}, which the model does not have{hint}. "
        f"The model's modules are: {layout.describe()}"
    )


@torch.no_grad()
def check_stage_forwards(stages: list[nn.Module], first_inputs: tuple[torch.Tensor, ...]) -> None:
    """Run the stages (on meta, in order) once, so that a forward the stage cut cannot follow
    (a block it never calls, a module that needs inputs another stage computed) fails here,
    on every rank before any communication, with the stage named, instead of deep inside a
    schedule. An op meta cannot run (``nonzero``, a kernel whose meta function is narrower
    than its CPU one) runs on CPU on zeros instead, logged (:mod:`autopp.stage_split.meta_run`):
    a forward that trains in plain torch is not refused for it."""
    x = tuple(t.to("meta") for t in first_inputs)
    for i, stage in enumerate(stages):
        try:
            run = run_on_meta(stage, *x)  # under the adapters' contexts (tracing.on_meta)
        except (TypeError, RuntimeError, ValueError) as e:
            raise ValueError(
                f"stage {i} of {len(stages)} cannot run the model's forward on its modules "
                f"({type(e).__name__}: {e}). Each stage runs the whole forward with the "
                "modules other stages hold passed through (they return their first input); "
                "a forward that passes each block's output to the next block, with anything "
                "else the blocks take computed from constants, buffers or the input's shape, "
                "splits (see autopp.stage_split.build)"
            ) from e
        if run.on_cpu:
            logging.getLogger("autopp").info(
                "stage %d of %d: checked on meta with %s run on CPU on zeros (no meta form)",
                i, len(stages), ", ".join(run.on_cpu))
        out = run.output
        x = out if isinstance(out, tuple) else (out,)
