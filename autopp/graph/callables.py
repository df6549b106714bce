"""``StageGraphs``: the split callables of one pipeline stage, callable by hand or by a schedule.

The methods follow the graph-stage protocol of torch's schedule runtime handlers (the names
``unshard_params`` / ``forward`` / ``full_backward`` / ``backward_input`` /
``backward_weight`` / ``reduce_grads``), so a ``StageGraphs`` plugs straight into
:class:`autopp.graph.GraphStage`. All values are flat lists of plain tensors, except the
forward output, the input grads and the accumulated parameter grads, which are rewrapped
into their tensor subclasses (DTensor) when the traced stage had them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from autopp._compat import graph as _compat
from autopp.graph.convention import CallingConvention


@dataclasses.dataclass(frozen=True, slots=True)
class ValueLayouts:
    """How flat graph values rewrap into the stage's semantic values (DTensor or plain)."""

    outputs: _compat.GraphPPValueSpec
    """Forward outputs (with the pytree structure of the stage's output)."""
    param_grads: _compat.GraphPPValueSpec
    """Parameter gradients, one per trainable parameter."""
    input_grads: _compat.GraphPPValueSpec
    """Gradients of the differentiable user inputs."""

    @staticmethod
    def plain(num_outputs: int, num_param_grads: int, num_input_grads: int) -> "ValueLayouts":
        """Layouts for graphs whose values are all plain tensors."""
        spec = _compat.graph_pp_value_spec
        return ValueLayouts(
            outputs=spec({}, start=0, count=num_outputs),
            param_grads=spec({}, start=0, count=num_param_grads),
            input_grads=spec({}, start=0, count=num_input_grads),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _EagerLoss:
    """What a last stage with an eager loss keeps for its backward, after the graphs' values."""

    loss: torch.Tensor
    outputs: list[torch.Tensor]


def _run(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, ...]:
    with torch.no_grad():
        out = fn(*args)
    if isinstance(out, (tuple, list)):
        return tuple(out)
    return (out,)


@dataclasses.dataclass(slots=True)
class StageGraphs:
    """Forward, backward, backward-input (I), backward-weight (W), unshard and reduce-grad
    callables of one pipeline stage, with their :class:`CallingConvention`.

    Build one with :func:`autopp.graph.split_joint_graph` (from any flat joint graph) or
    :func:`autopp.graph.build_stage_graphs` (trace a module and split it).
    """

    forward_graph: fx.GraphModule
    """Forward for one microbatch: returns the stage outputs, then the saved values."""
    full_backward_graph: fx.GraphModule
    """Whole backward: returns the (unreduced) param grads, then the input grads."""
    convention: CallingConvention
    """Calling convention of all the callables."""
    layouts: ValueLayouts
    """Rewrapping of outputs and gradients into tensor subclasses."""
    backward_input_graph: fx.GraphModule | None = None
    """Input-gradient half of the backward (I); ``None`` when the stage has no input grads."""
    backward_weight_graph: fx.GraphModule | None = None
    """Weight-gradient half of the backward (W); runs later on ``backward_input``'s live-ins."""
    unshard_graph: fx.GraphModule | None = None
    """Parameter all-gathers peeled off the forward; ``None`` when there are none."""
    reduce_grad_graph: fx.GraphModule | None = None
    """Gradient reduce-scatters / all-reduces peeled off the backward; ``None`` if none."""
    input_meta: tuple[torch.Tensor, ...] = ()
    """Meta tensors shaped like one microbatch of the positional inputs (when traced)."""
    output_meta: tuple[torch.Tensor, ...] = ()
    """Meta tensors shaped like the outputs, the loss on the last stage (when traced)."""
    runners: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    """Compiled replacements of the graphs above, by name (see :func:`compile_stage_graphs`)."""
    collectives_ahead: bool = False
    """UNSHARD and REDUCE_GRAD issue their graphs' collectives and return without waiting
    for those whose results the graph returns as they are (:meth:`issue_unshard`,
    :meth:`issue_reduce_grads`). The runtime waits for the gathers just before the stage's
    next action (its first forward), as torch's own runtime waits for an FSDP module's
    ``unshard(async_op=True)``, and for the reductions when the step accumulates the
    gradients. So an UNSHARD placed ahead of another stage's compute (interleaved and V
    schedules put every local stage's UNSHARD at the step's start) runs under it, and so
    does a REDUCE_GRAD followed by another local stage's backward. Not for a compiled
    runner of either graph."""
    state_as_local_shards: bool = False
    """How the schedule runtime hands DTensor parameters and buffers to the graphs: as their
    local shards (graphs lowered from a sharding plan, collectives explicit), and reduced
    gradients come back as DTensors like their parameters; False: as torch's subclass
    flattening (``__tensor_flatten__``: graphs traced on DTensors, e.g. SimpleFSDP)."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    """An eager loss after the graphs (see :meth:`with_eager_loss`); None: the graphs end in
    the stage's outputs (or in the loss, when traced with one)."""
    keyword_inputs: tuple[str, ...] = ()
    """Names of the keyword inputs the graphs take after the positional ones, in that order
    (the schedule hands each microbatch's as a dict, by name); empty: keyword inputs are
    flattened after the positional ones as they come."""
    _issued: dict[str, tuple] = dataclasses.field(default_factory=dict, repr=False,
                                                   compare=False)
    """Graph name -> (the graph, its copy with the returned waits deferred, their
    positions): made once each, by :meth:`issue_unshard` / :meth:`issue_reduce_grads`."""

    def with_eager_loss(self, loss_fn: Callable[[Any, Any], torch.Tensor],
                        loss_meta: torch.Tensor | None = None) -> "StageGraphs":
        """These graphs as a last stage whose loss runs eagerly after them.

        ``loss_fn(output, target)`` is called on the graphs' output (what :meth:`forward`
        returns without a loss) under autograd; the backward seeds the graphs' backward with
        the loss's gradient of that output. Any Python loss works this way, including ones
        that do not trace (DTensor's ``loss_parallel``, data-dependent weighting). The graphs
        must have been traced without a loss (with output grads).
        """
        if self.convention.signature.is_last:
            raise ValueError("these graphs were traced with a loss already; trace the stage "
                             "without loss_fn to run a loss eagerly after it")
        out = dataclasses.replace(self, loss_fn=loss_fn)
        out.output_meta = (loss_meta if loss_meta is not None
                           else torch.empty((), device="meta"),)
        return out

    @property
    def ends_in_loss(self) -> bool:
        """Whether :meth:`forward` returns the stage's loss (traced in, or eager)."""
        return self.convention.signature.is_last or self.loss_fn is not None

    def graphs(self) -> dict[str, fx.GraphModule]:
        """The graph modules that exist, by name."""
        named = {
            "forward": self.forward_graph,
            "full_backward": self.full_backward_graph,
            "backward_input": self.backward_input_graph,
            "backward_weight": self.backward_weight_graph,
            "unshard": self.unshard_graph,
            "reduce_grad": self.reduce_grad_graph,
        }
        return {k: v for k, v in named.items() if v is not None}

    def _fn(self, name: str) -> Callable[..., Any]:
        fn = self.runners.get(name)
        return fn if fn is not None else self.graphs()[name]

    # -- the protocol used by the schedule runtime ------------------------------------
    @property
    def supports_backward_input_weight_split(self) -> bool:
        """Whether BACKWARD_INPUT and BACKWARD_WEIGHT can run as separate actions."""
        return self.backward_input_graph is not None and self.backward_weight_graph is not None

    @property
    def num_unsharded_param_grad_values(self) -> int:
        """Number of flat parameter-gradient accumulator slots."""
        return self.convention.signature.num_param_grads

    def unshard_params(self, flat_param_values: list[Any], *, runtime_validate: bool = False) -> list[Any]:
        """All-gather the parameters: one unsharded value per flat parameter."""
        conv = self.convention
        self._check_param_count(flat_param_values)
        if self.unshard_graph is None:
            return list(flat_param_values)
        args = [flat_param_values[i] for i in conv.unshard_param_indices]
        return list(_run(self._fn("unshard"), args))

    def issue_unshard(self, flat_param_values: list[Any]) -> tuple[list[Any], tuple[int, ...]]:
        """As :meth:`unshard_params`, but with :attr:`collectives_ahead` the all-gathers
        the graph returns directly are left in flight: returns the values and the positions
        of those still to wait for (``wait_tensor`` on each before it is read)."""
        if not self._ahead("unshard"):
            return self.unshard_params(flat_param_values), ()
        self._check_param_count(flat_param_values)
        args = [flat_param_values[i] for i in self.convention.unshard_param_indices]
        return self._issue("unshard", args)

    def issue_reduce_grads(self, unsharded_param_grads: list[Any]
                           ) -> tuple[list[Any], tuple[int, ...]]:
        """As :meth:`reduce_grads`, leaving the reductions it returns directly in flight
        (with :attr:`collectives_ahead`): the values and the positions still to wait for."""
        if not self._ahead("reduce_grad") or (
                len(unsharded_param_grads) != self.convention.signature.num_param_grads):
            return self.reduce_grads(unsharded_param_grads), ()
        return self._issue("reduce_grad", [unsharded_param_grads[i]
                                           for i in self.convention.reduce_grad_inputs])

    def _check_param_count(self, flat_param_values: list[Any]) -> None:
        n = self.convention.signature.num_params
        if len(flat_param_values) != n:
            raise ValueError(
                f"unshard_params got {len(flat_param_values)} flat parameters, the stage "
                f"was traced with {n}; pass the same module's parameters.")

    def _ahead(self, name: str) -> bool:
        return (self.collectives_ahead and self.graphs().get(name) is not None
                and name not in self.runners)

    def _issue(self, name: str, args: list[Any]) -> tuple[list[Any], tuple[int, ...]]:
        from autopp.graph.overlap import defer_output_waits

        gm = self.graphs()[name]
        hit = self._issued.get(name)
        if hit is None or hit[0] is not gm:
            hit = self._issued[name] = (gm, *defer_output_waits(gm))
        return list(_run(hit[1], args)), hit[2]

    def forward_flat(self, unsharded_params: Sequence[Any], buffers: Sequence[Any],
                     user_inputs: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Run the forward on flat values; returns ``(flat_outputs, saved_for_backward)``."""
        conv = self.convention
        sig = conv.signature
        if len(user_inputs) != sig.num_user_inputs:
            raise ValueError(
                f"forward got {len(user_inputs)} flat user inputs, the stage was traced with "
                f"{sig.num_user_inputs}; the previous stage's outputs must match this stage's inputs."
            )
        # With an unshard graph, its outputs feed the leading forward inputs and the other
        # forward inputs index buffers / user inputs only; without one, they index params too.
        params = unsharded_params if self.unshard_graph is None else [None] * sig.num_params
        flat = [*params, *buffers, *user_inputs]
        args = list(unsharded_params[: conv.num_unsharded_params])
        args += [flat[i] for i in conv.forward_input_indices]
        out = _run(self._fn("forward"), args)
        n = sig.num_outputs
        k = conv.num_unsharded_params
        saved = out[n : n + conv.num_saved_for_backward]
        return out[:n], (*saved, *unsharded_params[k : k + conv.num_backward_unsharded])

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                loss_kwargs: dict[str, Any], *, unsharded_param_values: list[Any],
                flat_buffer_values: list[Any], runtime_validate: bool = False,
                ) -> tuple[Any, tuple[Any, ...]]:
        """Run the forward of one microbatch; returns ``(stage_output, saved_for_backward)``."""
        if self.keyword_inputs or kwargs:
            kwargs = self._keyword_values(kwargs)
        tree = (args, kwargs, target, loss_kwargs) if self.convention.signature.is_last else (args, kwargs)
        leaves, _ = _compat.tree_flatten((tree, {}))
        user_inputs = _compat.flatten_graph_values(list(leaves))
        outs, saved = self.forward_flat(unsharded_param_values, flat_buffer_values, user_inputs)
        output = self.layouts.outputs.unflatten(outs)
        if self.layouts.outputs.tree_spec is None:  # plain layout: one tensor or a tuple
            output = output[0] if len(output) == 1 else tuple(output)
        if self.loss_fn is None:
            return output, saved
        if not torch.is_grad_enabled():  # evaluation: no backward will follow
            return self.loss_fn(output, target), saved
        flat, spec = _compat.tree_flatten(output)
        leaves = [o.detach().requires_grad_(o.is_floating_point()) for o in flat]
        with torch.enable_grad():
            loss = self.loss_fn(_compat.tree_unflatten(leaves, spec), target)
        # The runtime keeps the returned loss until the step ends; detached, it does not keep
        # the stage's output (the logits) alive past this microbatch's backward, which reads
        # the live loss from the saved values.
        return loss.detach(), (*saved, _EagerLoss(loss, leaves))

    def _keyword_values(self, kwargs: dict[str, Any]) -> Any:
        """The microbatch's keyword inputs in the order the graphs take them."""
        if not self.keyword_inputs:
            return kwargs
        if set(kwargs) != set(self.keyword_inputs):
            raise ValueError(
                f"this stage's graphs take the keyword inputs {list(self.keyword_inputs)}, "
                f"got {sorted(kwargs)}; pass exactly those to step/eval (they were planned "
                "for them), or build the pipeline for the ones you pass")
        return [kwargs[name] for name in self.keyword_inputs]

    def _loss_grads(self, saved: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """With an eager loss: (saved values of the graphs, gradients of their outputs)."""
        *saved, eager = saved
        if not isinstance(eager, _EagerLoss):
            raise ValueError("the last stage's forward did not run with gradients enabled; "
                             "run the step's forward and backward under autograd")
        grads = torch.autograd.grad(eager.loss, eager.outputs, allow_unused=True)
        grads = tuple(torch.zeros_like(o) if g is None else g
                      for g, o in zip(grads, eager.outputs))
        return tuple(saved), grads

    def _backward_args(self, saved: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        if self.loss_fn is not None:
            saved, output_grads = self._loss_grads(saved)
        conv = self.convention
        n_saved = conv.num_saved_for_backward
        if len(saved) != n_saved + conv.num_backward_unsharded:
            raise ValueError(
                f"backward got {len(saved)} saved values, the forward saves "
                f"{n_saved + conv.num_backward_unsharded}; pass the values the forward returned."
            )
        grads = _compat.flatten_graph_values(list(output_grads))
        if conv.output_grad_inputs and len(grads) != conv.signature.num_output_grads:
            raise ValueError(
                f"backward got {len(grads)} output grads, the stage has "
                f"{conv.signature.num_output_grads} outputs; the next stage's input grads "
                "must match this stage's outputs."
            )
        supplied = [*saved[n_saved:], *grads]
        return [*saved[:n_saved], *(supplied[i] for i in conv.output_grad_inputs)]

    def full_backward(self, stage_output: Any, saved_values_for_backward: tuple[Any, ...],
                      output_grads_from_next: tuple[Any, ...], *, runtime_validate: bool = False,
                      ) -> tuple[list[Any], list[Any]]:
        """Whole backward; returns ``(input_grads, unreduced_param_grads)``."""
        out = _run(self._fn("full_backward"),
                   self._backward_args(saved_values_for_backward, output_grads_from_next))
        n = self.convention.signature.num_param_grads
        return self.layouts.input_grads.wrap_flat_values(out[n:]), list(out[:n])

    def backward_input(self, stage_output: Any, saved_values_for_backward: tuple[Any, ...],
                       output_grads_from_next: tuple[Any, ...], *, runtime_validate: bool = False,
                       ) -> tuple[list[Any], tuple[Any, ...]]:
        """Input-gradient half (I); returns ``(input_grads, weight_live_ins)``."""
        if self.backward_input_graph is None:
            raise ValueError("this stage has no backward-input graph (it has no input grads); "
                             "use full_backward instead.")
        out = _run(self._fn("backward_input"),
                   self._backward_args(saved_values_for_backward, output_grads_from_next))
        n = self.convention.signature.num_input_grads
        return self.layouts.input_grads.wrap_flat_values(out[:n]), tuple(out[n:])

    def backward_weight(self, saved_values_for_backward_weight: tuple[Any, ...]) -> list[Any]:
        """Weight-gradient half (W); returns the unreduced param grads."""
        if self.backward_weight_graph is None:
            raise ValueError("this stage has no backward-weight graph; use full_backward instead.")
        return list(_run(self._fn("backward_weight"), saved_values_for_backward_weight))

    def reduce_grads(self, unsharded_param_grads: list[Any], *, runtime_validate: bool = False) -> list[Any]:
        """Reduce-scatter / all-reduce the accumulated param grads (identity if none)."""
        if len(unsharded_param_grads) != self.convention.signature.num_param_grads:
            raise ValueError(
                f"reduce_grads got {len(unsharded_param_grads)} grads, expected "
                f"{self.convention.signature.num_param_grads} (one per trainable parameter)."
            )
        if self.reduce_grad_graph is None:
            return list(unsharded_param_grads)
        args = [unsharded_param_grads[i] for i in self.convention.reduce_grad_inputs]
        return list(_run(self._fn("reduce_grad"), args))

    def param_grads_for_accumulation(self, sharded_param_grads: list[Any]) -> list[Any]:
        """Rewrap reduced flat grads as the parameters' types (e.g. DTensor)."""
        return self.layouts.param_grads.wrap_flat_values(sharded_param_grads)
