"""``parallelize="auto"``, runtime side: a planned stage as a pipeline stage runs it.

:func:`materialize_and_apply` creates the stage's parameters shard by shard in the planned
placements (:mod:`autopp.auto_plan` made the plans), initialises them and applies the plan;
:class:`AutoStage` is what torch's ``PipelineStage`` runs: it takes and returns this rank's
local tensors in the boundary placements, and in between runs the planned units' lowered
local graphs (collectives explicit). Gradients of its DTensor parameters come out already
reduced over dp (a sum), so the pipeline does not average them again; weight gradients are
deferred to the schedule's W actions and reduced once per step. :func:`fqn_view` gives the
planned parameters back their whole-model names, for optimizers, state dicts and checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopp.init import init_module_
from autopp.sharding import StagePlan
from autopp.sharding.apply import apply_plan, empty_sharded_
from autopp.sharding.local_run import WeightGradQueue
from autopp.sharding.plan import from_strs


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
        #: Weight-gradient work deferred by the backward: pass ``weight_grads.builder`` as
        #: the pipeline stage's ``dw_builder`` (zero-bubble schedules run it at W).
        self.weight_grads = WeightGradQueue()
        sharded.use_weight_grad_queue(self.weight_grads)
        self._mesh = mesh
        self._in = list(from_strs(plan.input_placements))
        self._out = list(from_strs(plan.output_placements))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        # Between a backward and the dw_builder call that claims its work no forward runs, so
        # anything queued now is from a backward nobody claimed (see WeightGradQueue.discard).
        self.weight_grads.discard()
        dxs = [DTensor.from_local(x, self._mesh, self._in, run_check=False) for x in xs]
        y = self.sharded(*dxs)
        if isinstance(y, DTensor):
            y = y.redistribute(self._mesh, self._out).to_local()
        return y

    def finish_step(self) -> None:
        """After the schedule's step: reduce the gradients summed over its microbatches."""
        self.sharded.flush_grads()

    def named_whole_model_parameters(self):
        return self.sharded.named_planned_parameters()


def materialize_and_apply(
    stage_meta: nn.Module, plan: StagePlan, sub_mesh: DeviceMesh,
    example_inputs: tuple[torch.Tensor, ...], *, seed: int, device: torch.device,
) -> AutoStage:
    """Create the stage's parameters shard by shard in the planned placements, initialise
    them (split-independent init: each parameter's full value exists only while it is
    initialised and sharded), then run it as planned."""
    import copy

    stage = empty_sharded_(copy.deepcopy(stage_meta), plan, sub_mesh, device)
    for mod in stage.modules():  # buffers (e.g. RoPE caches) are small: materialise whole
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty_like(b, device=device)
    init_module_(stage, seed=seed, device=device)
    return AutoStage(apply_plan(stage, plan, sub_mesh, example_inputs), sub_mesh, plan)


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
