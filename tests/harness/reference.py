"""The single-process reference of every parity test, built one way.

Plain torch on one process: the whole model on CPU in fp32, ``F.cross_entropy`` (or the
test's loss), ``loss.backward()``, ``clip_grad_norm_`` and ``torch.optim.AdamW``. The only
autopp code it runs is :func:`autopp.init_module_`, so that the reference starts from the
weights autopp gives every split; that function is checked against each model's own
initialisation by ``tests/base/test_init_and_loss.py`` and ``tests/models/test_transformers_models.py``,
never through this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tests.harness.models import ce_loss, logits_of

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class Reference:
    """What a parity test compares with."""

    losses: list[float]
    """The loss of each batch, before that batch's optimizer step."""
    grads: dict[str, torch.Tensor]
    """The first batch's gradients, by every FQN (a tied parameter under each of its names)."""
    norm: float
    """The first batch's global gradient norm, accumulated in float64."""
    model: nn.Module
    """The model after the run (the last batch's backward done, its step not taken)."""
    first_buffers: dict[str, torch.Tensor]
    """Buffers named by ``keep_buffers`` after the first batch's ``after_backward``."""


def reference_run(model: nn.Module, batches: Sequence[Batch], *, lr: float | None = None,
                  max_norm: float | None = None, param_dtype: torch.dtype | None = None,
                  seed: int = 0, loss_fn: Callable = ce_loss, microbatches: int = 1,
                  after_backward: Callable[[nn.Module], None] | None = None,
                  keep_buffers: Callable[[str], bool] | None = None,
                  threads: int | None = None) -> Reference:
    """Train ``model`` (meta or CPU; initialised here by autopp's per-FQN seeds, ``seed``)
    on ``batches`` in one process.

    Each batch ``(tokens, target)``: the forward (on parameters cast to ``param_dtype`` when
    given, gradients flowing back to the fp32 masters), ``loss_fn`` on the logits (a
    transformers output object gives its ``.logits``), the backward; a batch split into
    ``microbatches`` sums each microbatch's loss over their count, as a pipeline does.
    Between batches (never after the last): ``after_backward(model)``, then
    ``clip_grad_norm_(max_norm)`` when given, then AdamW at ``lr``. ``threads`` pins torch's
    thread count for the run (the reference's own rounding depends on it)."""
    from autopp import init_module_

    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        model = init_module_(model, seed=seed, device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=lr) if lr is not None else None
        losses: list[float] = []
        grads: dict[str, torch.Tensor] = {}
        first_buffers: dict[str, torch.Tensor] = {}
        norm = 0.0
        for i, (tokens, target) in enumerate(batches):
            loss = sum(loss_fn(logits_of(_forward(model, x, param_dtype)), t) / microbatches
                       for x, t in zip(tokens.chunk(microbatches), target.chunk(microbatches)))
            loss.backward()
            losses.append(float(loss))
            if i == 0:
                grads = {n: p.grad.detach().clone()
                         for n, p in model.named_parameters(remove_duplicate=False)}
                norm = float(torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(p.grad, dtype=torch.float64)
                     for p in model.parameters() if p.grad is not None])))
            if i == len(batches) - 1:
                break
            if after_backward is not None:
                after_backward(model)
            if i == 0 and keep_buffers is not None:
                first_buffers = {n: b.clone() for n, b in model.named_buffers()
                                 if keep_buffers(n)}
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if opt is not None:
                opt.step()
                opt.zero_grad()
        return Reference(losses, grads, norm, model, first_buffers)
    finally:
        torch.set_num_threads(saved_threads)


def _forward(model: nn.Module, tokens: torch.Tensor, param_dtype: torch.dtype | None):
    if param_dtype is None:
        return model(tokens)
    cast = {n: p.to(param_dtype) for n, p in model.named_parameters()}
    return torch.func.functional_call(model, cast, (tokens,))
