"""The model's keyword inputs (``attention_mask``, ``position_ids``, ...) as the planner takes
them: checked against the step's inputs, and cut to one dp-global microbatch, the shape
every planned stage traces them at. Light (torch only): :mod:`autopp.api` imports it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def example_keyword_inputs(example_kwargs: Mapping[str, torch.Tensor] | None,
                           example_inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``example_kwargs`` checked (tensors batched like the inputs) and sorted by name: what
    :func:`autopp.pipeline_autoparallel`, :func:`autopp.plan_pipeline` and
    :func:`autopp.dry_run.dry_run` plan for."""
    batch = int(example_inputs[0].shape[0]) if example_inputs else None
    out = {}
    from autopp.stage_split.build import is_model_input

    for name, t in sorted((example_kwargs or {}).items()):
        if is_model_input(name):
            raise ValueError(f"example_kwargs[{name!r}]: autopp passes the model's positional "
                             "inputs to its stages by that name; give the model's inputs as "
                             "example_inputs, and rename this keyword")
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or (
                batch is not None and t.shape[0] != batch):
            what = (f"a tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                    else type(t).__name__)
            raise ValueError(f"example_kwargs[{name!r}] is {what}: keyword inputs are split "
                             f"into microbatches on dim 0 like the inputs, so each must be a "
                             f"tensor whose dim 0 is this dp rank's batch ({batch})")
        out[name] = t
    return out


def microbatch_keyword_inputs(keyword_inputs: Mapping[str, torch.Tensor] | None,
                              n_microbatches: int, dp: int) -> dict[str, torch.Tensor]:
    """Meta tensors of the keyword inputs of one dp-global microbatch (what each stage is
    planned with), from those of one step on one dp rank."""
    return {name: torch.empty((t.shape[0] // n_microbatches * dp, *t.shape[1:]),
                              dtype=t.dtype, device="meta")
            for name, t in (keyword_inputs or {}).items()}
