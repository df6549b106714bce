"""Run a planned unit as its lowered local graphs (the default executor).

:func:`autopp.sharding.lower.lower_joint` turns a unit's plan into one local joint graph with
explicit collectives, and :func:`~autopp.sharding.lower.split_local` cuts it into forward,
backward, backward-input (I), backward-weight (W) and reduce-grad graphs. Here those graphs
run under autograd, one :class:`LocalBlockFunction` per unit: the forward graph saves what the
backward needs (no recomputation), the backward graphs compute the gradients and the
reduce-grad graph reduces them into their parameters' placements.

Zero-bubble and V schedules defer weight gradients. torch's ``PipelineStage`` runs the whole
autograd backward at the I action and calls its ``dw_builder`` right after; with a
:class:`WeightGradQueue`, each unit's backward runs only its I graph and queues its W graph,
and the builder hands the queued work of that backward to the schedule's W action. The W
work sums each microbatch's unreduced parameter gradients locally; the reduce-grad graph
runs once per step (:meth:`LocalRunner.flush`), so the gradient reduce-scatters and
all-reduces happen once per step, not once per microbatch (reduction is linear).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopp.sharding.interpret import redistribute_to
from autopp.sharding.plan import from_strs


class WeightGradQueue:
    """Weight-gradient work the units of one stage deferred during a backward.

    Pass :meth:`builder` as torch ``PipelineStage``'s ``dw_builder``: called after each
    backward, it takes the work queued by that backward and returns the callable the
    schedule's W action runs.
    """

    def __init__(self, reduce_once_per_step: bool = True) -> None:
        self.pending: list[Callable[[], None]] = []
        #: Sum the units' unreduced gradients over a step's microbatches and reduce them
        #: once at its end (``flush``), as FSDP does under pipelining, instead of reducing
        #: every microbatch's gradients.
        self.reduce_once_per_step = reduce_once_per_step
        #: Units' weight-gradient computations run from this queue so far (W work deferred).
        self.weight_grads_run = 0

    def discard(self) -> None:
        """Drop work queued by a backward that no builder claimed: torch 2.13's stage runs one
        real backward (input gradients only) to infer gradient shapes before the first step,
        and its weight gradients must not land in the first microbatch's W."""
        self.pending.clear()

    def builder(self) -> Callable[[], None]:
        items, self.pending = self.pending, []

        def run_weight_grads() -> None:
            for fn in items:
                fn()
            self.weight_grads_run += len(items)

        return run_weight_grads


def _wrap(local: torch.Tensor, like: DTensor | Any, mesh, placements) -> DTensor:
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


class LocalBlockFunction(torch.autograd.Function):
    """One planned unit: DTensor input and parameters in, DTensor output; runs local graphs."""

    @staticmethod
    def forward(ctx, block: "LocalRunner", x: DTensor, *params: DTensor) -> DTensor:
        local_params = [p.to_local() for p in params]
        outs, saved = block.graphs.forward_flat(local_params, block.local_buffers(), [x.to_local()])
        ctx.block, ctx.saved, ctx.x_meta = block, saved, (x.shape, x.stride())
        ctx.params = params
        return DTensor.from_local(
            outs[0], block.mesh, block.out_placements, run_check=False,
            shape=block.out_shape, stride=block.out_stride,
        )

    @staticmethod
    def backward(ctx, grad: DTensor):
        block: LocalRunner = ctx.block
        g = redistribute_to(grad, block.out_placements)
        g = g.to_local() if isinstance(g, DTensor) else g
        graphs, saved, params = block.graphs, ctx.saved, ctx.params
        del ctx.saved
        queue = block.queue
        if queue is not None and graphs.supports_backward_input_weight_split:
            input_grads, live = graphs.backward_input(None, saved, (g,))

            def weight_grads() -> None:
                block.add_param_grads(params, graphs.backward_weight(live))

            queue.pending.append(weight_grads)
            pgrads = [None] * len(params)
        elif queue is not None:  # no input/weight split (e.g. an embedding): W has no work
            input_grads, unreduced = graphs.full_backward(None, saved, (g,))
            queue.pending.append(lambda: block.add_param_grads(params, unreduced))
            pgrads = [None] * len(params)
        else:
            input_grads, unreduced = graphs.full_backward(None, saved, (g,))
            reduced = graphs.reduce_grads(unreduced)
            pgrads = [
                _wrap(r, p, block.mesh, pl) if p.requires_grad else None
                for r, p, pl in zip(reduced, params, block.param_placements)
            ]
        gx = None
        if input_grads and input_grads[0] is not None:
            shape, stride = ctx.x_meta
            gx = DTensor.from_local(input_grads[0], block.mesh, block.in_placements,
                                    run_check=False, shape=shape, stride=stride)
        return (None, gx, *pgrads)


class LocalRunner:
    """What :class:`LocalBlockFunction` needs of a unit: its split graphs and placements.

    Args:
        graphs: the unit's split local graphs (:func:`autopp.sharding.lower.split_local`).
        local: the lowered joint (its placements), see :class:`~autopp.sharding.lower.LocalJoint`.
        mesh: the sub-mesh.
        buffers: the unit's DTensor buffers, in the graph's order.
        out_meta: a tensor shaped like the unit's (global) output.
    """

    def __init__(self, graphs, local, mesh, buffers: list[DTensor], out_meta: torch.Tensor):
        sig = local.signature
        n_p, n_b, n_in = sig.num_params, sig.num_buffers, sig.num_user_inputs
        self.graphs, self.mesh = graphs, mesh
        self.param_placements = [from_strs(p) for p in local.input_placements[:n_p]]
        self.in_placements = from_strs(local.input_placements[n_p + n_b])
        self.out_placements = from_strs(local.output_placements[0])
        if n_in != 1 or sig.num_outputs != 1:
            raise ValueError("a planned unit takes one tensor input and returns one output")
        self.out_shape, self.out_stride = out_meta.shape, out_meta.stride()
        self._buffers = buffers
        self.queue: WeightGradQueue | None = None
        self._unreduced: list[torch.Tensor] | None = None
        self._params: tuple[nn.Parameter, ...] = ()

    def local_buffers(self) -> list[torch.Tensor]:
        return [b.to_local() for b in self._buffers]

    def add_param_grads(self, params: tuple[nn.Parameter, ...], unreduced: list[torch.Tensor]
                        ) -> None:
        """Take one microbatch's unreduced parameter gradients: summed locally when the
        queue reduces once per step (see :meth:`flush`), else reduced and accumulated now."""
        if self.queue is None or not self.queue.reduce_once_per_step:
            self.accumulate(params, self.graphs.reduce_grads(unreduced))
            return
        if self._unreduced is None:
            self._unreduced = [g.clone() for g in unreduced]
        else:
            for acc, g in zip(self._unreduced, unreduced):
                acc.add_(g)
        self._params = params

    def flush(self) -> None:
        """Reduce the gradients summed over this step's microbatches (one reduce-scatter /
        all-reduce per parameter per step) into the parameters' ``.grad``."""
        if self._unreduced is not None:
            self.accumulate(self._params, self.graphs.reduce_grads(self._unreduced))
            self._unreduced, self._params = None, ()

    def accumulate(self, params: tuple[nn.Parameter, ...], grads: list[torch.Tensor]) -> None:
        """Add reduced local gradients to the parameters' ``.grad`` (DTensors)."""
        with torch.no_grad():
            for p, g, pl in zip(params, grads, self.param_placements):
                if not p.requires_grad:
                    continue
                d = _wrap(g, p, self.mesh, pl)
                p.grad = d if p.grad is None else p.grad + d
