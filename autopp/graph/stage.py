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

import collections
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopp._compat import graph as _compat
from autopp._compat.distributed import wait_collective
from autopp.graph.callables import StageGraphs
from autopp.graph.comm_counter import CollectiveCounter


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
        if graphs.ends_in_loss != is_last:
            raise ValueError(
                f"stage {stage_index} of {num_stages} is {'' if is_last else 'not '}the last stage "
                f"but its graphs {'end' if graphs.ends_in_loss else 'do not end'} in a loss; "
                "trace the last stage with loss_fn (or add one with graphs.with_eager_loss) and "
                "the others without."
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
    def __init__(self, schedule: Any) -> None:
        super().__init__(schedule)
        #: Actions run since the runtime was made, by kind ("F", "B", "I", "W", "UNSHARD",
        #: "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B"); "W" counts weight-gradient graphs that
        #: really ran deferred (a W of a stage without an I/W split runs as a full backward,
        #: counted "B"; its I does nothing, counted "I (nothing to do)").
        self.action_counts: collections.Counter[str] = collections.Counter()
        #: The last actions run, in order, as (kind as counted, stage index, microbatch
        #: index or None): e.g. to check that each W ran after its I; and ("UNSHARD
        #: wait", stage, None) / ("REDUCE_GRAD wait", stage, None) where the collectives
        #: a stage's UNSHARD / REDUCE_GRAD left in flight were waited for.
        self.action_log: collections.deque[tuple[str, int, int | None]] = collections.deque(
            maxlen=100_000)
        #: Set by :meth:`count_collectives`: collectives run per action kind.
        self.collectives: CollectiveCounter | None = None
        #: Stage index -> positions of its gathered values still in flight since its
        #: UNSHARD (``StageGraphs.collectives_ahead``); waited before the stage's next
        #: action.
        self._unshard_pending: dict[int, tuple[int, ...]] = {}
        #: Stage index -> positions of its reduced gradients still in flight since its
        #: REDUCE_GRAD; waited (then scaled) when the step accumulates them.
        self._reduce_pending: dict[int, tuple[int, ...]] = {}

    def _stage(self, index: int) -> Any:
        """The local stage of index ``index``."""
        return next(s for s in _compat.schedule_stages(self.schedule) if s.stage_index == index)

    def count_collectives(self) -> CollectiveCounter:
        """From now on, count the collectives every action runs (see
        :class:`autopp.graph.comm_counter.CollectiveCounter`; slows the step down)."""
        self.collectives = CollectiveCounter()
        return self.collectives

    def _counted(self, kind: str, handler: Any) -> Any:
        def run(action: Any, ctx: Any) -> None:
            stages = _compat.schedule_stages(self.schedule)
            kind_run = kind
            if kind in ("I", "W"):
                stage = self._stage(action.stage_index)
                if not stage.graphs.supports_backward_input_weight_split:
                    # without an I/W split, I does nothing and W runs the full backward
                    kind_run = "B" if kind == "W" else "I (nothing to do)"
            if kind != "UNSHARD":
                self._wait_unsharded(action)
            self.action_counts[kind_run] += 1
            self.action_log.append((kind_run, action.stage_index, action.microbatch_index))
            counter = self.collectives
            if counter is None:
                return handler(action, ctx)
            self.ensure_ready(ctx)
            for stage in stages:
                counter.mark_params(stage.state.flat_param_values)
            counter.label = kind_run
            with counter:
                return handler(action, ctx)

        return run

    def _handle_unshard(self, action: Any, ctx: Any) -> None:
        """Issue the stage's all-gathers and return; :meth:`_wait_unsharded` waits for them
        before the stage's next action (``StageGraphs.issue_unshard``)."""
        self.ensure_ready(ctx)
        stage = self._stage(action.stage_index)
        if stage.state.unsharded_param_values:
            return
        values, pending = self.stage_graphs[stage.stage_index].issue_unshard(
            stage.state.flat_param_values)
        stage.state.unsharded_param_values = values
        if pending:
            self._unshard_pending[stage.stage_index] = pending

    def _handle_reduce_grad(self, action: Any, ctx: Any) -> None:
        """Issue the stage's gradient reductions and return; :meth:`_ensure_reduced_grads`
        waits for them (and scales them) when the step accumulates the gradients."""
        self.ensure_ready(ctx)
        stage = self._stage(action.stage_index)
        values, pending = self.stage_graphs[stage.stage_index].issue_reduce_grads(
            stage.state.unsharded_param_grads)
        stage.state.sharded_param_grads = values
        if pending:
            self._reduce_pending[stage.stage_index] = pending
        else:
            _compat.scale_sharded_grads(stage, self.schedule)

    def _ensure_reduced_grads(self, stage: Any) -> None:
        pending = self._reduce_pending.pop(stage.stage_index, ())
        if pending:
            grads = stage.state.sharded_param_grads
            for i in pending:
                grads[i] = wait_collective(grads[i])
            _compat.scale_sharded_grads(stage, self.schedule)
            self.action_log.append(("REDUCE_GRAD wait", stage.stage_index, None))
        super()._ensure_reduced_grads(stage)

    def _wait_unsharded(self, action: Any) -> None:
        """Wait for the gathers still in flight of the stages ``action`` runs (logged as
        ("UNSHARD wait", stage, None) in :attr:`action_log`, just before the action)."""
        for sub in getattr(action, "sub_actions", None) or (action,):
            pending = self._unshard_pending.pop(sub.stage_index, ())
            if not pending:
                continue
            stage = self._stage(sub.stage_index)
            values = stage.state.unsharded_param_values
            for i in pending:
                values[i] = wait_collective(values[i])
            self.action_log.append(("UNSHARD wait", sub.stage_index, None))

    def _populate_stage_states(self, stage: Any) -> None:
        super()._populate_stage_states(stage)
        self._unshard_pending.pop(stage.stage_index, None)  # a step that failed half-way
        self._reduce_pending.pop(stage.stage_index, None)
        if self.stage_graphs[stage.stage_index].state_as_local_shards:
            state = stage.state
            state.flat_param_values = [_compat.local_shard(p) for _, p in
                                       stage.submod.named_parameters(remove_duplicate=False)]
            state.flat_buffer_values = [_compat.local_shard(b) for _, b in
                                        stage.submod.named_buffers(remove_duplicate=False)]

    def _accumulate_stage_sharded_grads(self, stage: Any) -> None:
        graphs = self.stage_graphs[stage.stage_index]
        if not graphs.state_as_local_shards:
            return super()._accumulate_stage_sharded_grads(stage)
        self._ensure_reduced_grads(stage)
        params = stage.state.trainable_params
        grads = stage.state.sharded_param_grads
        if not grads:
            return
        if len(grads) != len(params):
            raise ValueError(f"stage {stage.stage_index}: {len(grads)} gradients for "
                             f"{len(params)} trainable parameters")
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is None:
                    continue
                g = _compat.like_param(g, p)
                p.grad = g if p.grad is None else p.grad + g

    def _handle_forward(self, action: Any, ctx: Any) -> None:
        super()._handle_forward(action, ctx)
        stage = self._stage(action.stage_index)
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
        _compat.FORWARD: ("F", runtime._handle_forward),
        _compat.FULL_BACKWARD: ("B", runtime._handle_full_backward),
        _compat.BACKWARD_INPUT: ("I", runtime._handle_backward_input),
        _compat.BACKWARD_WEIGHT: ("W", runtime._handle_backward_weight),
        _compat.UNSHARD: ("UNSHARD", runtime._handle_unshard),
        _compat.RESHARD: ("RESHARD", runtime._handle_reshard),
        _compat.REDUCE_GRAD: ("REDUCE_GRAD", runtime._handle_reduce_grad),
        _compat.OVERLAP_F_B: ("OVERLAP_F_B", runtime._handle_overlap_fw_bw),
    }
    for kind, (name, fn) in handlers.items():
        schedule.register_custom_function(kind, runtime._counted(name, fn))
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
