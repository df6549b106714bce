"""Every stage's inputs for one dp-global microbatch, found by running the stages on meta
in order (what the planner plans each stage for, and what a :class:`~autopp.plan.value.PipelinePlan`
records so that nothing downstream runs the model again)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autopp import tracing
from autopp.tracing.precision import CastParams


@torch.no_grad()
def stage_input_shapes(
    stage_modules: Sequence[nn.Module], first_inputs: Sequence[torch.Tensor],
    compute_dtype: torch.dtype | None = None,
    keyword_inputs: Mapping[str, torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Meta example inputs of every stage, from the first stage's (meta) inputs.

    ``stage_modules`` are all stages of the model, on meta, in order. With mixed precision,
    ``compute_dtype`` (the policy's ``param_dtype``) is the dtype of the activations the
    stages exchange. ``keyword_inputs``: the stages' keyword inputs; when the model's inputs
    are among them (a forward that reads its input), every stage runs on them.
    """
    inputs: list[tuple[torch.Tensor, ...]] = []
    x: tuple[torch.Tensor, ...] = tuple(t.to("meta") for t in first_inputs)
    given = _model_inputs(x, keyword_inputs)
    for m in stage_modules:
        inputs.append(x)
        out = _run_on_meta(m, x, compute_dtype, given)
        x = out if isinstance(out, tuple) else (out,)
        if compute_dtype is not None:
            x = tuple(t.to(compute_dtype) if t.is_floating_point() else t for t in x)
    return inputs


@torch.no_grad()
def last_stage_output(metas: Sequence[nn.Module], inputs: Sequence[tuple[torch.Tensor, ...]],
                      mixed_precision: Any = None,
                      keyword_inputs: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The last stage's (meta) output for its example inputs: the logits the loss reads
    (``keyword_inputs`` as for :func:`stage_input_shapes`)."""
    pd = mixed_precision.param_dtype if mixed_precision is not None else None
    out = _run_on_meta(metas[-1], inputs[-1], pd, _model_inputs(inputs[0], keyword_inputs))
    return out[0] if isinstance(out, tuple) else out


def _model_inputs(first_inputs: Sequence[torch.Tensor],
                  keyword_inputs: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The model's inputs as the keywords every stage takes them by, when
    ``keyword_inputs`` holds them (:mod:`autopp.stage_split.model_inputs`); else none."""
    from autopp.stage_split.build import is_model_input, model_input_keywords

    if not any(is_model_input(k) for k in keyword_inputs or ()):
        return {}
    return model_input_keywords(tuple(t.to("meta") for t in first_inputs))


def _run_on_meta(module: nn.Module, inputs: Sequence[torch.Tensor],
                 compute_dtype: torch.dtype | None,
                 keywords: Mapping[str, torch.Tensor] | None = None) -> Any:
    """``module(*inputs, **keywords)`` on meta (parameters cast to ``compute_dtype`` when
    given), with the model adapters' tracing forms (e.g. a MoE router's autocast, which
    meta refuses)."""

    with tracing.on_meta():
        return (module if compute_dtype is None else CastParams(module, compute_dtype))(
            *inputs, **(keywords or {}))


def stage_meta_inputs(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]],
                      first_input: torch.Tensor, n_microbatches: int, dp: int,
                      compute_dtype: torch.dtype | None = None,
                      stage_modules: Sequence[nn.Module] | None = None,
                      keyword_inputs: Mapping[str, torch.Tensor] | None = None,
                      ) -> tuple[list[nn.Module], list[tuple[torch.Tensor, ...]]]:
    """All stages of ``model`` on meta, and their inputs for one dp-global microbatch (what
    planners see); ``first_input``: the model's first input for one step on one dp rank;
    ``stage_modules``: the stages already built on meta (None: built here);
    ``keyword_inputs``: as for :func:`stage_input_shapes`."""
    from autopp.stage_split import build_stage_module

    x = first_input
    mb = x.shape[0] // n_microbatches * dp
    first = (torch.empty((mb, *x.shape[1:]), dtype=x.dtype, device="meta"),)
    metas = (list(stage_modules) if stage_modules is not None else
             [build_stage_module(model, list(f), allow_tied=True) for f in fqns_per_stage])
    return metas, stage_input_shapes(metas, first, compute_dtype, keyword_inputs)


def meta_stage_inputs(spec: Any, compute_dtype: torch.dtype | None = None
                      ) -> tuple[list[nn.Module], list[tuple[torch.Tensor, ...]]]:
    """:func:`stage_meta_inputs` of ``spec`` (a :class:`autopp.backends.PipelineSpec`),
    reusing its stage modules when it has them (one meta forward per stage)."""
    return stage_meta_inputs(spec.model, spec.fqns_per_stage, spec.example_inputs[0],
                             spec.n_microbatches, spec.dp, compute_dtype,
                             stage_modules=spec.stage_modules or None,
                             keyword_inputs=dict(spec.keyword_inputs))
