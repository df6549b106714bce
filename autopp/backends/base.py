"""What a stage backend is: how a pipeline's stages are parallelized over their sub-meshes.

:class:`~autopp.pipeline.Pipeline` does the same things for every backend (split, place,
schedule, normalise the loss, clip, checkpoint); everything that depends on *how* a stage is
parallelized is a method of its :class:`StageBackend`: planning before the stages are built,
building each stage on meta, materialising it, wrapping it as a pipeline stage, what its
gradients mean over dp, what happens after a step, and how it describes itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSpec:
    """What a backend may look at before the stages are built."""

    model: nn.Module
    """The whole model on the meta device."""
    fqns_per_stage: tuple[tuple[str, ...], ...]
    """Module FQNs of each stage, in stage order."""
    stage_ids: tuple[int, ...]
    """The stages this rank holds."""
    rank_of: tuple[int, ...]
    """The pp rank of each stage."""
    mesh: DeviceMesh
    """The ("pp", "dp", "tp") world mesh."""
    sub_mesh: DeviceMesh
    """This rank's ("dp", "tp") stage sub-mesh."""
    example_inputs: tuple[torch.Tensor, ...]
    """The model's inputs for one step on this dp rank (batch on dim 0)."""
    n_microbatches: int
    """Microbatches per step."""
    loss_fn: LossFn
    """The user's loss (mean over a microbatch's counted tokens)."""
    schedule: str = ""
    """The schedule's name (or CSV path)."""
    stage_modules: tuple[nn.Module, ...] = ()
    """Every stage's module on the meta device, in stage order, built once per rank by
    :func:`autopp.pipeline_autoparallel`; the backend builds its stages from these."""
    keyword_inputs: tuple[tuple[str, torch.Tensor], ...] = ()
    """(name, tensor) of the keyword inputs of the model's forward the pipeline is built to
    take with every step (``example_kwargs``; batch on dim 0, this dp rank's)."""

    @property
    def dp(self) -> int:
        return self.sub_mesh["dp"].size()


class StageBackend(ABC):
    """How each pipeline stage is parallelized over its sub-mesh (see the module docstring).

    Methods are called in this order: :meth:`prepare` once (all ranks, collective),
    :meth:`build` per local stage (meta), then at ``Pipeline.init_weights``
    :meth:`materialize` and :meth:`pipeline_stage` per local stage; :meth:`after_step`
    after every training step.
    """

    #: Short name for logs and ``describe()``.
    name: str = "backend"
    #: True: parameter gradients come out summed over dp (DTensor semantics), so the loss is
    #: not scaled by dp; False: averaged over dp (the FSDP/DDP convention).
    grads_summed_over_dp: bool = False
    #: True: the stages take exactly the keyword inputs they were built for (graph inputs
    #: of their traces), so a step must pass those; False: any batched keyword inputs.
    takes_built_keyword_inputs: bool = False
    #: True: statistics the model's forward keeps (e.g. MoE token counts) come out reduced
    #: over dp; False: each dp rank's are partial, over its batch slice.
    stats_reduced_over_dp: bool = False

    def prepare(self, spec: PipelineSpec) -> None:  # noqa: B027 (optional hook)
        """Whole-pipeline work before the stages are built (planning); collective."""

    @abstractmethod
    def build(self, stage_id: int, stage_meta: nn.Module, sub_mesh: DeviceMesh) -> nn.Module:
        """The stage as the pipeline holds it before ``init_weights`` (still on meta)."""

    @abstractmethod
    def materialize(self, stage_id: int, module: nn.Module, sub_mesh: DeviceMesh, *,
                    seed: int, device: torch.device) -> nn.Module:
        """The stage on ``device`` with initialised weights (same values as the whole model
        initialised by :func:`autopp.init.init_module_` with ``seed``)."""

    def named_parameters(self, modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]] | None:
        """(whole-model FQN, parameter) of the materialised local stages, or None when the
        modules' own ``named_parameters`` already use whole-model FQNs."""
        return None

    def named_buffers(self, modules: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]] | None:
        """(whole-model FQN, buffer) of the materialised local stages when
        :meth:`named_parameters` is not None; None otherwise."""
        return None

    def pipeline_stage(self, stage_id: int, module: nn.Module, *, n_stages: int,
                       device: torch.device, pp_group: dist.ProcessGroup, loss_fn: LossFn,
                       get_mesh: Callable[..., DeviceMesh]) -> Any:
        """The torch pipeline stage running ``module`` (default: an autograd PipelineStage;
        the extra forward of its first-step shape inference leaves the training statistics
        the model's forward keeps, e.g. MoE token counts, as they were)."""
        from autopp import adapters
        from autopp._compat.pipelining import pipeline_stage_with_inference_context

        return pipeline_stage_with_inference_context(
            module, stage_id, n_stages, device, group=pp_group, get_mesh=get_mesh,
            context=lambda: adapters.training_state_kept([module], module))

    def build_schedule(self, schedule: str, stages: Sequence[Any], **kw: Any
                       ) -> tuple[Any, Any | None]:
        """The schedule running ``stages`` (``kw``: :func:`autopp.schedules.build_schedule`'s)
        and the runtime driving its actions (None: torch's own, under autograd)."""
        from autopp.schedules import build_schedule

        return build_schedule(schedule, stages, **kw), None

    def vocab_parallel_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The mesh the last stage's logits are split over on the vocabulary (loss parallel),
        or None when it returns whole logits."""
        return None

    def after_step(self, params: Sequence[nn.Parameter], mesh: DeviceMesh) -> None:  # noqa: B027
        """After each training step's backward (e.g. average replicated gradients over dp)."""

    def describe(self, stage_id: int, module: nn.Module | None) -> list[str]:
        """Lines describing how ``stage_id`` is parallelized (``module``: the built stage)."""
        return []

    @property
    def plans(self) -> dict[int, Any]:
        """{stage id: StagePlan} of this rank's stages, for backends that plan."""
        return {}
