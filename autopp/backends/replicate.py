"""``Replicate``: every stage replicated over its sub-mesh, gradients averaged over dp."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp.backends.base import StageBackend


class Replicate(StageBackend):
    """Each stage whole on every device of its sub-mesh (tp ranks compute the same thing);
    gradients averaged over dp with one flat all-reduce per dtype after the step. The
    correctness baseline the planner improves on (``parallelize=None``)."""

    name = "replicate"

    def build(self, stage_id: int, stage_meta: nn.Module, sub_mesh: DeviceMesh) -> nn.Module:
        return stage_meta

    def materialize(self, stage_id: int, module: nn.Module, sub_mesh: DeviceMesh, *,
                    seed: int, device: torch.device) -> nn.Module:
        from autopp.init import init_module_

        init_module_(module, seed=seed, device=device)
        return module

    def describe(self, stage_id: int, module: nn.Module | None) -> list[str]:
        return [f"  stage {stage_id}: replicated over its sub-mesh"]

    @torch.no_grad()
    def after_step(self, params: Sequence[nn.Parameter], mesh: DeviceMesh) -> None:
        dp = mesh["dp"].size()
        grads = [p.grad for p in params if p.grad is not None]
        if dp == 1 or not grads:
            return
        group = mesh["dp"].get_group()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, group=group)
            flat /= dp
            offset = 0
            for g in gs:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
