"""Typed calling conventions of a stage's joint graph and of the callables split from it.

A *joint graph* is one flat FX graph that runs a pipeline stage's forward and backward for
one microbatch. Its placeholders and outputs are laid out as::

    inputs : params, buffers, user_inputs, output_grads        (output_grads: not on the last stage)
    outputs: forward_outputs, param_grads, input_grads

``JointSignature`` records those counts, so nothing downstream relies on hard-coded
positions. ``CallingConvention`` is what splitting produces: which values the forward
saves for the backward, which backward inputs come from the schedule, and how the
unshard / reduce-grad / backward-weight pieces are fed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class JointSignature:
    """Layout of a flat joint forward+backward graph of one pipeline stage."""

    num_params: int
    """Flat parameter inputs (after tensor subclasses such as DTensor are unwrapped)."""
    num_buffers: int
    """Flat buffer inputs, after the parameters."""
    num_user_inputs: int
    """Flat user inputs (activations or tokens; on the last stage also target and loss kwargs)."""
    num_output_grads: int
    """Gradients of the stage outputs, supplied by the next stage; 0 on the last stage."""
    num_outputs: int
    """Leading graph outputs that are the stage's forward outputs (the loss on the last stage)."""
    num_param_grads: int
    """Graph outputs after the forward outputs that are parameter gradients."""
    input_grad_indices: tuple[int, ...] = ()
    """Which user inputs (indices into the flat user inputs) get a gradient output, in order."""
    is_last: bool = False
    """Whether the stage ends in a scalar loss (then there are no output grads to receive)."""

    def __post_init__(self) -> None:
        for name in ("num_params", "num_buffers", "num_user_inputs", "num_output_grads",
                     "num_param_grads"):
            if getattr(self, name) < 0:
                raise ValueError(f"JointSignature.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_outputs < 1:
            raise ValueError(
                f"JointSignature.num_outputs must be >= 1, got {self.num_outputs}: a stage "
                "must return at least one forward output (an activation or the loss)."
            )
        if self.is_last and self.num_output_grads:
            raise ValueError(
                "The last stage differentiates a scalar loss and receives no output grads; "
                f"got num_output_grads={self.num_output_grads}. Set is_last=False or "
                "num_output_grads=0."
            )
        if not self.is_last and self.num_output_grads == 0:
            raise ValueError(
                "A non-last stage needs the gradients of its outputs as backward inputs "
                "(num_output_grads > 0); trace the joint graph with the output grads as "
                "inputs, or set is_last=True if the stage returns the loss."
            )
        bad = [i for i in self.input_grad_indices if not 0 <= i < self.num_user_inputs]
        if bad or len(set(self.input_grad_indices)) != len(self.input_grad_indices):
            raise ValueError(
                f"JointSignature.input_grad_indices {self.input_grad_indices} must be distinct "
                f"indices into the {self.num_user_inputs} flat user inputs."
            )
        if self.num_param_grads + self.num_input_grads == 0:
            raise ValueError(
                "The joint graph has no backward: it returns no parameter or input gradients. "
                "Trace the stage with a backward (torch.autograd.grad of the outputs) and make "
                "sure its parameters require grad."
            )

    @property
    def num_input_grads(self) -> int:
        """Number of gradient outputs for user inputs (sent to the previous stage)."""
        return len(self.input_grad_indices)

    @property
    def num_state_inputs(self) -> int:
        """Parameters plus buffers."""
        return self.num_params + self.num_buffers

    @property
    def num_graph_inputs(self) -> int:
        """Placeholders the joint graph must have."""
        return self.num_state_inputs + self.num_user_inputs + self.num_output_grads

    @property
    def num_graph_outputs(self) -> int:
        """Outputs the joint graph must have."""
        return self.num_outputs + self.num_param_grads + self.num_input_grads

    @property
    def output_grad_input_indices(self) -> tuple[int, ...]:
        """Joint-graph placeholder indices of the output grads (backward-only inputs)."""
        start = self.num_state_inputs + self.num_user_inputs
        return tuple(range(start, start + self.num_output_grads))


@dataclass(frozen=True, slots=True, kw_only=True)
class CallingConvention:
    """How the split callables of one stage are called, and what flows between them.

    Calls, in schedule order::

        unshard(params[unshard_param_indices])               -> unsharded_params
        forward(unsharded_params[:num_unsharded_params],
                flat_inputs[forward_input_indices])          -> outputs, saved_for_backward
        full_backward(saved_for_backward, (bwd_unsharded + output_grads)[output_grad_inputs])
                                                             -> param_grads, input_grads
        backward_input(saved_for_backward, output_grads)     -> input_grads, weight_live_ins
        backward_weight(weight_live_ins)                     -> param_grads
        reduce_grad(param_grads by reduce_grad_inputs)       -> reduced param grads

    ``flat_inputs`` is ``params + buffers + user_inputs``; ``bwd_unsharded`` are the
    ``num_backward_unsharded`` unshard outputs after the forward's."""

    signature: JointSignature
    """Layout of the joint graph this convention was split from."""
    saved_for_backward: tuple[str, ...]
    """Names of the forward outputs (after the stage outputs) that the backward consumes."""
    backward_inputs: tuple[str, ...]
    """Placeholder names of the backward graphs: saved values, then output grads used."""
    output_grad_inputs: tuple[int, ...]
    """For each backward input after the saved values: index into the received output grads."""
    num_unsharded_params: int
    """Leading forward inputs that are (unsharded) parameter values."""
    forward_input_indices: tuple[int, ...]
    """Indices into ``flat_inputs`` of the remaining forward inputs, in order."""
    unshard_param_indices: tuple[int, ...] = ()
    """Flat parameter indices fed to ``unshard`` (empty: no unshard graph)."""
    reduce_grad_inputs: tuple[int, ...] = ()
    """Indices into the unreduced param grads fed to ``reduce_grad`` (empty: no reduce)."""
    num_weight_live_ins: int = 0
    """Values ``backward_input`` hands to ``backward_weight`` (0: backward is not split)."""
    num_backward_unsharded: int = 0
    """Unsharded parameter values only the backward reads (after the forward's
    ``num_unsharded_params`` in the unshard outputs): the forward hands them on with its saved
    values, by reference, and they precede the output grads in the backward's runtime
    inputs that ``output_grad_inputs`` indexes."""
    recompute: str = "none"
    """What the backward pieces recompute instead of the forward saving it: ``"none"``,
    ``"selective"`` or ``"full"`` (see :mod:`autopp.graph.recompute`); it changes which
    values are saved, not how the callables are called."""

    @property
    def num_saved_for_backward(self) -> int:
        """Number of values the forward saves for the backward."""
        return len(self.saved_for_backward)

    @property
    def has_split_backward(self) -> bool:
        """Whether backward-input / backward-weight callables exist."""
        return self.num_weight_live_ins > 0
