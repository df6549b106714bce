"""Memory a pipeline rank holds outside its stage graphs' own values, one formula per term.

Each is held the whole step, so it is a fixed number of bytes per stage or rank. The
simulator shows each as a category (:data:`MEMORY_CATEGORIES`), the planner takes them off
its budgets (:func:`autopp.plan.budgets.fixed_stage_bytes`) and the dry run prints them;
all three call these functions.

* Receive buffers (:func:`receive_buffer_bytes`): torch's ``PipelineStage`` allocates one
  input buffer per microbatch (every stage but the first) and one output-gradient buffer per
  microbatch (every stage but the last) when the schedule first prepares it, and keeps them
  across steps: M of each all step, not one per microbatch in flight. A V's hand-off between
  stages on one rank replaces the buffer by the sender's tensor: the same count.
* Buffers (:func:`module_buffer_bytes`): a stage's registered buffers, one copy per stage.
* Communicators (:func:`communicator_bytes`): the profile's allowance per process group."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def receive_buffer_bytes(n_microbatches: int, input_bytes: int, output_grad_bytes: int) -> int:
    """Bytes of a stage's receive buffers: ``n_microbatches`` buffers of its input (0 for the
    first stage) and as many of its output's gradient (0 for the last stage), per device."""
    return n_microbatches * (input_bytes + output_grad_bytes)


def stage_receive_bytes(n_microbatches: int, send_bytes: Sequence[int]) -> list[int]:
    """Per stage, :func:`receive_buffer_bytes` from the pipeline's send bytes per microbatch
    (``send_bytes[s]``: what stage s sends to s + 1, its output gradient's size too; 0 for
    the last stage)."""
    return [receive_buffer_bytes(n_microbatches, send_bytes[s - 1] if s > 0 else 0,
                                 send_bytes[s]) for s in range(len(send_bytes))]


def module_buffer_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s registered buffers (each storage once), as one whole copy: what
    a stage holds for them (a buffer is not sharded by the plan)."""
    seen: set[int] = set()
    total = 0
    for b in module.buffers():
        if id(b) in seen:
            continue
        seen.add(id(b))
        total += b.numel() * b.element_size()
    return total


def communicator_bytes(per_group: float, mesh_shape: Sequence[int]) -> int:
    """Bytes a rank holds for its process groups: ``per_group`` for each mesh dim of size > 1
    (the pp, dp and tp groups of a ``(pp, dp, tp)`` mesh that communicate)."""
    return int(per_group) * sum(1 for n in mesh_shape if n > 1)
