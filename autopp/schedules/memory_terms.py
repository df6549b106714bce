"""Memory a pipeline rank holds outside its stage graphs' own values, one formula per term.

Each is held for the whole step, so it is a fixed number of bytes per stage (or per rank).
The schedule simulator shows each as its own category (:data:`MEMORY_CATEGORIES`), the
planner takes them off the budget its ILP plans under
(:func:`autopp.plan.budgets.fixed_stage_bytes`), and the dry run's memory table prints the
simulator's columns; all three call these functions.

* Receive buffers (:func:`receive_buffer_bytes`). torch 2.13's ``PipelineStage``
  (``torch/distributed/pipelining/stage.py``) allocates them once, when the schedule first
  prepares the stage, and keeps them across steps: ``_setup_forward_recv_info`` makes one
  input buffer per microbatch for every stage but the first (``_make_tensor_from_meta`` at
  line 2270, stored in ``args_recv_info[chunk_id]``), and ``_setup_backward_recv_info``
  (line 322) one output-gradient buffer per microbatch for every stage but the last
  (``_create_grad_recv_info``, line 2314, in ``grad_recv_info[mb_index]``). ``_get_recv_ops``
  (line 349) posts each irecv into its microbatch's buffer. So a stage holds ``M`` input
  buffers and ``M`` gradient buffers all step, not one per microbatch in flight. Between two
  stages on one rank (a V's turn) the hand-off replaces the buffer by the sender's tensor
  (``set_local_fwd_input`` / ``set_local_bwd_input``), which the buffer then keeps alive until
  the next step replaces it: the same count.
* Materialised buffers (:func:`module_buffer_bytes`): a stage's registered buffers (e.g. a
  RoPE table), one whole copy per stage.
* Communicators (:func:`communicator_bytes`): a fixed allowance per process group a rank
  uses (the profile's ``communicator_bytes``; see
  :attr:`autopp.profiles.DeviceProfile.communicator_bytes`).
"""

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
