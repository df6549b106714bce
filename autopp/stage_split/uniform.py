"""Uniform split by layer count, with the pre and post modules weighted as extra layers.

torchtitan's rule, so the two give identical splits: the model counts
``n_layers + input_weight + output_weight`` units; each stage gets ``units // n_stages`` and
the first ``units % n_stages`` one more; stage 0's pre modules use ``input_weight`` of its
units and the last stage's post modules ``output_weight``; layers fill the rest in order. A
model without pre (or post) modules weighs them 0. Example: 6 layers, weights 1 and 1, two
stages: ``[[tok_embeddings, layers.0-2], [layers.3-5, norm, lm_head]]``."""

from __future__ import annotations

from autopp.stage_split.layout import ModelLayout

__all__ = ["split_uniform"]


def split_uniform(
    layout: ModelLayout,
    n_stages: int,
    *,
    input_weight: int = 1,
    output_weight: int = 1,
) -> list[list[str]]:
    """Split the model into ``n_stages`` stages of about equal layer count.

    Args:
        layout: the model's layout, from :func:`autopp.stage_split.inspect_model`.
        n_stages: number of pipeline stages (all virtual stages, for looped schedules).
        input_weight: how many layers the pre modules (embedding) count as.
        output_weight: how many layers the post modules (norm + head) count as.

    Returns:
        For each stage, the module FQNs it holds, in model order.

    Raises:
        ValueError: ``n_stages`` < 1 or more than the model has units (layers plus weights),
            a negative weight, or a weight larger than the share of the stage that holds it.
    """
    for name, value, minimum in (
        ("n_stages", n_stages, 1),
        ("input_weight", input_weight, 0),
        ("output_weight", output_weight, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    pre_weight = input_weight if layout.pre else 0
    post_weight = output_weight if layout.post else 0
    n_layers = layout.n_layers
    total = n_layers + pre_weight + post_weight
    if n_stages > total:
        raise ValueError(
            f"cannot split into {n_stages} stages: more stages than layers. The model has "
            f"{n_layers} layers (+ input_weight {pre_weight} + output_weight {post_weight} "
            f"= {total} units, at most one stage per unit)"
        )
    base, extra = divmod(total, n_stages)
    units = [base + (1 if s < extra else 0) for s in range(n_stages)]
    n_layers_per_stage = list(units)
    n_layers_per_stage[0] -= pre_weight
    n_layers_per_stage[-1] -= post_weight
    if n_layers_per_stage[0] < 0:
        raise ValueError(
            f"input_weight {pre_weight} is more than stage 0's share of {units[0]} units "
            f"({n_layers} layers over {n_stages} stages); lower input_weight or use fewer stages"
        )
    if n_layers_per_stage[-1] < 0:
        raise ValueError(
            f"output_weight {post_weight} is more than the last stage's share of {units[-1]} "
            f"units ({n_layers} layers over {n_stages} stages); lower output_weight or use "
            "fewer stages"
        )
    layer_fqns = layout.layer_fqns
    stages: list[list[str]] = []
    start = 0
    for count in n_layers_per_stage:
        stages.append(list(layer_fqns[start : start + count]))
        start += count
    stages[0][:0] = layout.pre
    stages[-1].extend(layout.post)
    return stages
