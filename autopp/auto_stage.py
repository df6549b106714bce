"""``parallelize="auto"``: plan each local stage over its sub-mesh and run the planned stage.

Glue between the pipeline and the planner (:mod:`autopp.sharding`):

1. :func:`stage_input_shapes` finds every stage's input (a microbatch, with the dp-global batch
   size the planner works in) by running the meta model stage by stage on meta tensors.
2. :func:`plan_local_stage` plans a stage on the sub-mesh (cached on disk, see
   :mod:`autopp.plan_cache`).
3. :class:`AutoStage` is what torch's ``PipelineStage`` runs: it takes and returns this rank's
   local tensors (batch sharded over dp, replicated over tp, as the previous and next stages
   hold them), and in between runs the planned stage on DTensors, whose collectives are the
   plan's. Gradients of its DTensor parameters come out already reduced over dp (a sum), so
   the pipeline does not average them again.
4. :func:`fqn_view` gives the planned parameters back their whole-model names, for
   optimizers, state dicts and checkpoints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopp.init import init_module_
from autopp.plan_cache import cached_plan, plan_key
from autopp.sharding import StagePlan, plan_stage
from autopp.sharding.apply import apply_plan
from autopp.sharding.plan import from_strs

logger = logging.getLogger(__name__)


#: Placements (over dp, tp) an activation may have between two stages: the batch split over
#: dp and whole over tp, or also its sequence split over tp (1/tp of the bytes to send).
BOUNDARIES: dict[str, tuple[str, str]] = {"batch": ("S(0)", "R"), "batch+seq": ("S(0)", "S(1)")}


def boundary_kinds(sub_mesh: DeviceMesh) -> tuple[str, ...]:
    """The boundary placements worth comparing on ``sub_mesh`` (one when tp is 1)."""
    return ("batch", "batch+seq") if sub_mesh["tp"].size() > 1 else ("batch",)


def choose_boundaries(
    n_stages: int, kinds: Sequence[str], stage_time: Any, send_time: Any
) -> list[str]:
    """Boundary placement between each pair of stages, minimising the sum over stages of
    their planned time plus the time to send their boundary forward and back.

    ``stage_time(s, kind_in, kind_out)`` and ``send_time(s, kind)`` give seconds per
    microbatch; the first stage's input and the last stage's output are "batch". A dynamic
    program over the chain of boundaries (exact for this sum).
    """
    # best[k] = (cost of stages < s with boundary into s of kind k, choices so far)
    best: dict[str, tuple[float, list[str]]] = {"batch": (0.0, [])}
    for s in range(n_stages):
        outs = ("batch",) if s == n_stages - 1 else tuple(kinds)
        nxt: dict[str, tuple[float, list[str]]] = {}
        for k_out in outs:
            cands = [
                (cost + stage_time(s, k_in, k_out) + (send_time(s, k_out) if s < n_stages - 1 else 0.0),
                 chosen + ([k_out] if s < n_stages - 1 else []))
                for k_in, (cost, chosen) in best.items()
            ]
            nxt[k_out] = min(cands, key=lambda c: c[0])
        best = nxt
    return best["batch"][1]


@dataclass(frozen=True, slots=True)
class PlannedStage:
    """One local stage's plan and what it was planned with.

    Attributes:
        plan: the planner's StagePlan for the stage on its sub-mesh.
        example_inputs: meta tensors of one dp-global microbatch entering the stage.
        send_bytes: bytes this stage sends to the next one per microbatch, per device, in
            the chosen boundary placement; 0 for the last stage.
        boundary_out: the chosen placement of what it sends (a key of :data:`BOUNDARIES`).
    """

    plan: StagePlan
    example_inputs: tuple[torch.Tensor, ...]
    send_bytes: int
    boundary_out: str = "batch"


def boundary_bytes(t: torch.Tensor, dp: int, tp: int = 1, kind: str = "batch") -> int:
    """Bytes of a dp-global boundary activation held by one device in placement ``kind``."""
    split = dp * (tp if kind == "batch+seq" else 1)
    return t.numel() // split * t.element_size()


def default_profile(device_type: str) -> str:
    """The device profile the planner assumes when none is given, from the mesh's device type."""
    return "CPU" if device_type == "cpu" else "H100"


@torch.no_grad()
def stage_input_shapes(
    stage_modules: Sequence[nn.Module], first_inputs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, ...]]:
    """Meta example inputs of every stage, from the first stage's (meta) inputs.

    ``stage_modules`` are all stages of the model, on meta, in order.
    """
    inputs: list[tuple[torch.Tensor, ...]] = []
    x: tuple[torch.Tensor, ...] = tuple(t.to("meta") for t in first_inputs)
    for m in stage_modules:
        inputs.append(x)
        out = m(*x)
        x = out if isinstance(out, tuple) else (out,)
    return inputs


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
) -> StagePlan:
    """Plan ``stage`` (meta) over ``sub_mesh``; from the on-disk cache when possible.

    ``boundary_in`` / ``boundary_out`` name the placements of what the stage receives and
    sends (see :data:`BOUNDARIES`).
    """
    options = dict(profile=profile, memory_budget_bytes=memory_budget_bytes,
                   boundary_in=boundary_in, boundary_out=boundary_out)
    key = plan_key(stage, example_inputs, tuple(sub_mesh.shape), sub_mesh.mesh_dim_names, options)
    t0 = time.perf_counter()
    plan, hit = cached_plan(
        key,
        lambda: plan_stage(
            stage, example_inputs, sub_mesh, profile=profile,
            memory_budget_bytes=memory_budget_bytes,
            input_placements=BOUNDARIES[boundary_in],
            output_placements=BOUNDARIES[boundary_out],
        ),
    )
    logger.info(
        "stage %d: plan %s in %.1f s (%s)", stage_index, key[:12], time.perf_counter() - t0,
        "cached" if hit else "solved",
    )
    return plan


def agree_on_plans(plans: list[StagePlan], sub_mesh: DeviceMesh) -> list[StagePlan]:
    """The plans of the sub-mesh's first rank, on every rank of the sub-mesh.

    Ranks on one host already share one solve through the cache's lock; across hosts, a
    solver may return different but equally good optima, and the ranks of a stage must run
    the same plan. One small broadcast settles it.
    """
    if sub_mesh.size() == 1:
        return plans
    group = _flat_group(sub_mesh)
    box: list[Any] = [[p.to_json() for p in plans]]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return [StagePlan.from_json(t) for t in box[0]]


def _flat_group(mesh: DeviceMesh):
    return mesh._flatten().get_group() if mesh.ndim > 1 else mesh.get_group()


class AutoStage(nn.Module):
    """A planned stage as a pipeline stage runs it: local tensors in, local tensors out.

    Args:
        sharded: the planner's applied stage (DTensor parameters, plan's collectives).
        mesh: the stage's sub-mesh ("dp", "tp").
        plan: the stage's plan: its input and output placements are the boundaries.
    Inputs and outputs are this rank's shard in the plan's boundary placements (the batch
    split over dp; whole over tp, or the sequence split over tp).
    """

    def __init__(self, sharded: nn.Module, mesh: DeviceMesh, plan: StagePlan):
        super().__init__()
        self.sharded = sharded
        self._mesh = mesh
        self._in = list(from_strs(plan.input_placements))
        self._out = list(from_strs(plan.output_placements))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        dxs = [DTensor.from_local(x, self._mesh, self._in, run_check=False) for x in xs]
        y = self.sharded(*dxs)
        if isinstance(y, DTensor):
            y = y.redistribute(self._mesh, self._out).to_local()
        return y

    def named_whole_model_parameters(self):
        return self.sharded.named_planned_parameters()


def materialize_and_apply(
    stage_meta: nn.Module, plan: StagePlan, sub_mesh: DeviceMesh,
    example_inputs: tuple[torch.Tensor, ...], *, seed: int, device: torch.device,
) -> AutoStage:
    """Initialise the whole stage on ``device`` (split-independent init), then shard it."""
    import copy

    full = init_module_(copy.deepcopy(stage_meta), seed=seed, device=device)
    return AutoStage(apply_plan(full, plan, sub_mesh, example_inputs), sub_mesh, plan)


def fqn_view(named: Sequence[tuple[str, nn.Parameter]]) -> nn.Module:
    """A module tree holding ``named`` parameters under their FQNs (the same objects)."""
    root = nn.Module()
    for fqn, p in named:
        *path, leaf = fqn.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, p)
    return root
