"""One stage planned on its sub-mesh under its boundary placements, read from the on-disk
plan cache when it is there (its key: :func:`autopp.plan.cache.plan_key`). The one way the
pipeline's planning (:mod:`autopp.plan.make`) and the layout search's unit costs
(:mod:`autopp.layout_search.unit_costs`) plan a stage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp.plan.boundaries import BOUNDARIES
from autopp.plan.cache import cached_plan, plan_key
from autopp.sharding import StagePlan, plan_stage
from autopp.sharding.plan import describe_keyword_inputs

logger = logging.getLogger(__name__)


def plan_local_stage(
    stage: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    sub_mesh: DeviceMesh,
    *,
    profile: str,
    memory_budget_bytes: float | None,
    stage_index: int,
    boundary_in: str = "batch",
    boundary_out: str = "batch",
    timings: dict[int, list] | None = None,
    mixed_precision: Any = None,
    n_microbatches: int = 1,
    param_placements: dict[str, tuple[str, ...]] | None = None,
    memory: dict[str, Any] | None = None,
    tf32: bool | None = None,
    keyword_inputs: Mapping[str, torch.Tensor] | None = None,
) -> StagePlan:
    """Plan ``stage`` (meta) over ``sub_mesh``; from the on-disk cache when possible.

    ``boundary_in`` / ``boundary_out`` name the placements of what the stage receives and
    sends (see :data:`BOUNDARIES`). ``timings[stage_index]`` (if given) accumulates
    ``[seconds, plans solved, plans read from the cache]``. ``param_placements`` fixes some
    parameters' placements (stage FQN -> one placement string per mesh dim). ``memory``:
    :func:`~autopp.sharding.plan_stage`'s whole-memory accounting (``activation_factor``,
    ``recompute``, ``optimizer_state_factor``); without it ``memory_budget_bytes`` bounds
    parameter bytes only. ``tf32``: fp32 matmuls at the TF32 rate (``PlannerOptions.tf32``;
    None: as torch is set now, :func:`~autopp.profiles.devices.tf32_enabled`); in the key.
    ``keyword_inputs``: the model's keyword inputs for one dp-global microbatch (meta, by
    name), which the stage takes as graph inputs (names, shapes and dtypes in the key).
    """
    from autopp.profiles import get_profile
    from autopp.profiles.devices import tf32_enabled

    profile = get_profile(profile).name  # "measure" -> this machine's measured profile
    tf32 = tf32_enabled() if tf32 is None else bool(tf32)
    options = dict(profile=profile, memory_budget_bytes=memory_budget_bytes,
                   boundary_in=boundary_in, boundary_out=boundary_out, tf32=tf32)
    if param_placements:
        options["param_placements"] = sorted(param_placements.items())
    if mixed_precision is not None:
        options["mixed_precision"] = mixed_precision
    if n_microbatches > 1:
        options["microbatches_per_grad_reduce"] = n_microbatches
    if memory:
        options["memory"] = sorted(memory.items())
    if keyword_inputs:
        options["keyword_inputs"] = [[n, list(shape), d] for n, shape, d in
                                     describe_keyword_inputs(keyword_inputs)]
    key = plan_key(stage, example_inputs, tuple(sub_mesh.shape), sub_mesh.mesh_dim_names, options)
    t0 = time.perf_counter()
    plan, hit = cached_plan(
        key,
        lambda: plan_stage(
            stage, example_inputs, sub_mesh, profile=profile,
            memory_budget_bytes=memory_budget_bytes,
            input_placements=BOUNDARIES[boundary_in],
            output_placements=BOUNDARIES[boundary_out],
            mixed_precision=mixed_precision,
            microbatches_per_grad_reduce=n_microbatches,
            param_placements=param_placements, tf32=tf32, keyword_inputs=keyword_inputs,
            **(memory or {}),
        ),
    )
    plan = dataclasses.replace(plan, cache_entry=key)
    dt = time.perf_counter() - t0
    logger.info("stage %d: plan %s (%s -> %s) in %.1f s (%s)", stage_index, key[:12],
                boundary_in, boundary_out, dt, "cached" if hit else "solved")
    if timings is not None:
        t = timings.setdefault(stage_index, [0.0, 0, 0])
        t[0] += dt
        t[2 if hit else 1] += 1
    return plan
