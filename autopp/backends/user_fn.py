"""``Parallelize``: your own function parallelizes each stage (e.g. torchtitan's TP + FSDP2)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp.backends.base import StageBackend

ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module]


class Parallelize(StageBackend):
    """Stages parallelized by ``fn(stage_module, sub_mesh) -> module``.

    ``fn`` receives each stage on the meta device with its ("dp", "tp") sub-mesh and returns
    the parallelized module (e.g. ``parallelize_module`` for TP, then ``fully_shard`` over
    "dp"). Its gradients must be averaged over dp (the FSDP/DDP default).
    """

    name = "parallelize"

    def __init__(self, fn: ParallelizeFn) -> None:
        if not callable(fn):
            raise TypeError(f"Parallelize needs a callable (stage, sub_mesh) -> module, got {fn!r}")
        self.fn = fn

    def build(self, stage_id: int, stage_meta: nn.Module, sub_mesh: DeviceMesh) -> nn.Module:
        return self.fn(stage_meta, sub_mesh)

    def materialize(self, stage_id: int, module: nn.Module, sub_mesh: DeviceMesh, *,
                    seed: int, device: torch.device) -> nn.Module:
        from autopp.init import init_module_

        init_module_(module, seed=seed, device=device)
        return module

    def describe(self, stage_id: int, module: nn.Module | None) -> list[str]:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return [f"  stage {stage_id}: parallelized by {name}"]
