"""Loss normalisation across microbatches and data-parallel ranks.

A pipeline computes the loss one microbatch at a time. Averaging per-microbatch means (what
``scale_grads=True`` in torch's schedules amounts to) is not the loss of the unpipelined model
when microbatches hold different numbers of counted tokens (torchtitan issue 2972). autopp
instead weights each microbatch's mean loss by ``tokens_in_microbatch / tokens_in_global_batch``,
so the sum over microbatches and dp ranks is exactly the mean over all counted tokens of the
global batch, and gradients match the single-process model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy over the counted tokens (fp32).

    ``logits`` are ``(batch, seq, vocab)``, ``target`` ``(batch, seq)``. Pass this function
    itself as ``loss_fn`` to let the planner compute the loss in parallel over tp (the
    logits then stay split on the vocabulary; see ``PlannerOptions.loss_parallel``);
    the pipeline's ``ignore_index`` is used then.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), target.flatten(0, 1), ignore_index=ignore_index
    )


def vocab_parallel_cross_entropy_sum(
    logits: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh, ignore_index: int
) -> torch.Tensor:
    """Summed cross entropy of this rank's tokens, the logits split on the vocabulary.

    ``logits``: this rank's ``(batch/dp, seq, vocab/tp)`` shard; ``target``: its
    ``(batch/dp, seq)`` targets, whole over tp. Runs torch's ``loss_parallel`` (three
    all-reduces over tp of one float per token; no gather). Returns a local scalar: the sum
    over this rank's counted tokens, equal on the tp ranks.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    # Over dp every rank holds its own tokens (a plain local loss); only tp is loss-parallel.
    tp_mesh = mesh["tp"]
    dl = DTensor.from_local(logits.flatten(0, 1).float(), tp_mesh, [Shard(1)], run_check=False)
    dt = DTensor.from_local(target.flatten(0, 1), tp_mesh, [Replicate()], run_check=False)
    with loss_parallel():
        loss = F.cross_entropy(dl, dt, reduction="sum", ignore_index=ignore_index)
    return loss.to_local()


def count_tokens(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Number of target elements that count towards the loss (``!= ignore_index``)."""
    return (target != ignore_index).sum()


@dataclass(slots=True)
class TokenWeightedLoss:
    """The loss torch's schedule calls per microbatch (with ``scale_grads=False``).

    ``loss_fn(output, target)`` must return the mean over the microbatch's counted tokens
    (as ``F.cross_entropy(..., ignore_index=...)`` does). Before each step the pipeline sets
    ``global_tokens``, the counted tokens of the whole global batch (all microbatches, all dp
    ranks). ``grad_scale`` compensates a data-parallel gradient reduction that averages over
    ``dp`` ranks (the FSDP/DDP default): it is the dp degree.
    """

    loss_fn: LossFn
    ignore_index: int
    grad_scale: float = 1.0
    global_tokens: torch.Tensor | None = field(default=None)
    vocab_parallel_mesh: DeviceMesh | None = None
    """Set when the last stage's logits arrive split on the vocabulary over this sub-mesh's
    tp (loss parallel): the loss is then :func:`vocab_parallel_cross_entropy_sum`."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.global_tokens is None:
            raise RuntimeError("TokenWeightedLoss.global_tokens must be set before a step")
        if self.vocab_parallel_mesh is not None:
            total = vocab_parallel_cross_entropy_sum(
                output, target, self.vocab_parallel_mesh, self.ignore_index
            )
            return total * (self.grad_scale / self.global_tokens.to(total.dtype))
        mean = self.loss_fn(output, target)
        n = count_tokens(target, self.ignore_index).to(mean.dtype)
        # A microbatch with no counted tokens contributes 0 (its mean is NaN).
        weighted = torch.where(n > 0, mean * n, torch.zeros_like(mean))
        return weighted * (self.grad_scale / self.global_tokens.to(mean.dtype))
