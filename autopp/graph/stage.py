"""Graph stages on torch.distributed.pipelining's schedule runtime.

``GraphStage`` is a pipeline stage whose compute is a :class:`StageGraphs`; ``attach_graph_runtime``
registers handlers for every runtime action (FORWARD, FULL_BACKWARD, BACKWARD_INPUT,
BACKWARD_WEIGHT, UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP_F_B) on a ``_PipelineScheduleRuntime``
schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, ...).

Reused: torchtitan's ``GraphPipelineStage`` (stage state) and ``GraphPipelineRuntime`` (the
action handlers: recv waits, caches, same-rank hand-off, grad accumulation and scaling).
Written here: stage construction from traced metadata, the OVERLAP_F_B handler (torchtitan
needs a multiplexed fwd+bwd graph built by its GraphTrainer; we run the two halves in
turn, which is what DualPipeV needs to be correct), and the chain check between stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopp.graph import _compat
from autopp.graph.callables import StageGraphs


class GraphStage(_compat.GraphPipelineStage):
    """A pipeline stage that runs ``graphs`` instead of ``submodule``'s autograd.

    ``submodule`` still owns the parameters and buffers (the graphs read them, and the
    gradients land in their ``.grad``). Shapes of one microbatch's inputs and outputs come
    from the traced graphs, so torch's runtime needs no shape inference.
    """

    def __init__(
        self,
        submodule: nn.Module,
        graphs: StageGraphs,
        *,
        stage_index: int,
        num_stages: int,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(graphs, StageGraphs):
            raise ValueError(f"graphs must be a StageGraphs, got {type(graphs).__name__}")
        if not graphs.input_meta or not graphs.output_meta:
            raise ValueError(
                "graphs carry no input/output shapes; build them with "
                "autopp.graph.build_stage_graphs, or set graphs.input_meta / output_meta to meta "
                "tensors shaped like one microbatch's inputs and outputs."
            )
        is_last = stage_index == num_stages - 1
        if graphs.convention.signature.is_last != is_last:
            raise ValueError(
                f"stage {stage_index} of {num_stages} is {'' if is_last else 'not '}the last stage "
                f"but its graphs were traced {'with' if graphs.convention.signature.is_last else 'without'}"
                " a loss; trace the last stage with loss_fn and the others without."
            )
        super().__init__(
            submodule,
            stage_index=stage_index,
            num_stages=num_stages,
            device=torch.device(device),
            input_args=graphs.input_meta,
            output_args=graphs.output_meta,
            group=group,
        )
        self.set_graphs(graphs)


class _GraphRuntime(_compat.GraphPipelineRuntime):
    def _handle_forward(self, action: Any, ctx: Any) -> None:
        super()._handle_forward(action, ctx)
        stage = next(s for s in _compat.schedule_stages(self.schedule) if s.stage_index == action.stage_index)
        if stage.is_last and stage.output_chunks:
            # torch merges the last stage's outputs with torch.cat; a scalar loss cannot be
            # concatenated, so the returned value becomes the 1-D tensor of microbatch losses.
            last = stage.output_chunks[-1]
            if isinstance(last, torch.Tensor) and last.dim() == 0:
                stage.output_chunks[-1] = last.detach().reshape(1)

    def _handle_overlap_fw_bw(self, action: Any, ctx: Any) -> None:
        fw_action, bw_action = action.sub_actions
        self._handle_forward(fw_action, ctx)
        handler = {
            _compat.FULL_BACKWARD: self._handle_full_backward,
            _compat.BACKWARD_INPUT: self._handle_backward_input,
        }[bw_action.computation_type]
        handler(bw_action, ctx)


def attach_graph_runtime(schedule: Any) -> _compat.GraphPipelineRuntime:
    """Run ``schedule``'s actions with its stages' graphs; returns the runtime to ``step``.

    Call ``runtime.step(*inputs, target=..., losses=...)`` instead of ``schedule.step``:
    it also accumulates the reduced parameter gradients into the stage modules' ``.grad``
    (divided by the number of microbatches when the schedule scales grads).

    Raises:
        ValueError: ``schedule`` is not a runtime (multi-stage) schedule, or a local stage
            is not a :class:`GraphStage`.
    """
    if not _compat.is_runtime_schedule(schedule):
        raise ValueError(
            f"{type(schedule).__name__} is not a runtime schedule; graph stages need a "
            "multi-stage schedule such as Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
            "ZBVZeroBubble or DualPipeV (Interleaved1F1B with one stage per rank is 1F1B)."
        )
    bad = [type(s).__name__ for s in _compat.schedule_stages(schedule) if not isinstance(s, GraphStage)]
    if bad:
        raise ValueError(f"every local stage must be a GraphStage, got {bad}")
    runtime = _GraphRuntime(schedule)
    handlers = {
        _compat.FORWARD: runtime._handle_forward,
        _compat.FULL_BACKWARD: runtime._handle_full_backward,
        _compat.BACKWARD_INPUT: runtime._handle_backward_input,
        _compat.BACKWARD_WEIGHT: runtime._handle_backward_weight,
        _compat.UNSHARD: runtime._handle_unshard,
        _compat.RESHARD: runtime._handle_reshard,
        _compat.REDUCE_GRAD: runtime._handle_reduce_grad,
        _compat.OVERLAP_F_B: runtime._handle_overlap_fw_bw,
    }
    for kind, fn in handlers.items():
        schedule.register_custom_function(kind, fn)
    return runtime


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


def check_stage_chain(stages: Sequence[StageGraphs]) -> None:
    """Raise ``ValueError`` if a stage's outputs do not fit the next stage's inputs.

    Compares shapes and dtypes of ``stages[i].output_meta`` with ``stages[i+1].input_meta``
    and checks that only the last stage ends in a loss.
    """
    for i, (a, b) in enumerate(zip(stages, stages[1:])):
        if a.convention.signature.is_last:
            raise ValueError(f"stage {i} ends in a loss but is followed by stage {i + 1}; "
                             "only the last stage may be traced with loss_fn.")
        outs, ins = a.output_meta, b.input_meta
        same = len(outs) == len(ins) and all(
            o.shape == x.shape and o.dtype == x.dtype for o, x in zip(outs, ins)
        )
        if not same:
            raise ValueError(
                f"stage {i} outputs [{', '.join(map(_describe, outs))}] do not fit stage {i + 1} "
                f"inputs [{', '.join(map(_describe, ins))}]; trace stage {i + 1} with example "
                f"inputs shaped like stage {i}'s outputs (or fix the split)."
            )
    if stages and not stages[-1].convention.signature.is_last:
        raise ValueError("the last stage must be traced with loss_fn (it returns the loss).")
