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

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.global_tokens is None:
            raise RuntimeError("TokenWeightedLoss.global_tokens must be set before a step")
        mean = self.loss_fn(output, target)
        n = count_tokens(target, self.ignore_index).to(mean.dtype)
        # A microbatch with no counted tokens contributes 0 (its mean is NaN).
        weighted = torch.where(n > 0, mean * n, torch.zeros_like(mean))
        return weighted * (self.grad_scale / self.global_tokens.to(mean.dtype))
