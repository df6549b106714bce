"""``AutoParallel``: meta's AutoParallel plans each stage (``parallelize="autoparallel"``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

from autopp.backends.base import PipelineSpec, StageBackend


@dataclass
class AutoParallel(StageBackend):
    """Each stage planned and applied by meta-pytorch's AutoParallel over its sub-mesh, with
    the batch split over dp and whole over tp at both ends (see
    :mod:`autopp.backends.meta_autoparallel`). Its gradients are DTensor sums over dp.

    Args:
        mixed_precision: torch's ``MixedPrecisionPolicy``, passed to AutoParallel.
    """

    mixed_precision: MixedPrecisionPolicy | None = None
    _inputs: list[Any] = field(default_factory=list, init=False, repr=False)

    name = "autoparallel"
    grads_summed_over_dp = True

    def prepare(self, spec: PipelineSpec) -> None:
        from autopp.plan.stage_inputs import meta_stage_inputs
        from autopp.backends.meta_autoparallel import available, missing_error

        if not available():
            raise missing_error()
        _, self._inputs = meta_stage_inputs(spec)

    def build(self, stage_id: int, stage_meta: nn.Module, sub_mesh: DeviceMesh) -> nn.Module:
        from autopp.backends.meta_autoparallel import autoparallel_stage

        return autoparallel_stage(stage_meta, sub_mesh, self._inputs[stage_id],
                                  self.mixed_precision)

    def materialize(self, stage_id: int, module: nn.Module, sub_mesh: DeviceMesh, *,
                    seed: int, device: torch.device) -> nn.Module:
        from autopp.init import init_module_

        init_module_(module, seed=seed, device=device)
        return module

    def describe(self, stage_id: int, module: nn.Module | None) -> list[str]:
        return [f"  stage {stage_id}: planned by meta's AutoParallel"]
