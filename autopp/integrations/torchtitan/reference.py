"""torchtitan's own manual PP x FSDP x TP, runnable beside autopp for comparison.

Two small adapters let torchtitan 0.3.0's ``pipeline_llm`` and ``parallelize_llama`` run
under its own Trainer on torch 2.13 with gloo:

- :func:`pipeline_torchtitan` wraps the schedule in :class:`MicrobatchListSchedule`:
  torchtitan 0.3.0's Trainer calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)``
  (torch 2.14's signature); torch 2.13's schedules take the whole batch
  (``step(*args, target=, losses=, loss_kwargs=, **kwargs)``) and split it into the same
  microbatches themselves.
- :func:`parallelize_for_gloo` runs ``parallelize_fn`` and then makes every FSDP module
  reduce with SUM (torchtitan's FSDP reduces with ``PREMUL_SUM``, which gloo lacks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn


class MicrobatchListSchedule:
    """torch 2.13 schedule behind torchtitan 0.3.0's microbatch-list ``step`` / ``eval``."""

    def __init__(self, schedule) -> None:
        self.schedule = schedule

    @staticmethod
    def _join(arg_mbs, kwarg_mbs, target_mbs):
        args = () if arg_mbs is None else tuple(torch.cat(list(xs)) for xs in zip(*arg_mbs))
        kwargs: dict[str, Any] = {}
        for key in sorted({k for kw in (kwarg_mbs or []) for k in kw}):
            values = [kw[key] for kw in kwarg_mbs]
            kwargs[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]
        target = None if target_mbs is None else torch.cat(list(target_mbs))
        return args, kwargs, target

    def step(self, *, arg_mbs: Sequence[tuple[torch.Tensor, ...]] | None = None,
             kwarg_mbs: Sequence[dict[str, Any]] | None = None,
             target_mbs: Sequence[torch.Tensor] | None = None, losses: list | None = None,
             loss_kwargs: dict[str, Any] | None = None, return_outputs: bool = False):
        args, kwargs, target = self._join(arg_mbs, kwarg_mbs, target_mbs)
        return self.schedule.step(*args, target=target, losses=losses, loss_kwargs=loss_kwargs,
                                  return_outputs=return_outputs, **kwargs)

    def eval(self, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None):
        args, kwargs, target = self._join(arg_mbs, kwarg_mbs, target_mbs)
        return self.schedule.eval(*args, target=target, losses=losses, **kwargs)


def parallelize_for_gloo(model: nn.Module, *, parallelize_fn: Callable, **kwargs) -> nn.Module:
    """``parallelize_fn(model, **kwargs)``, then SUM reductions for FSDP on gloo."""
    model = parallelize_fn(model, **kwargs)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return model


def gloo_safe(parallelize_fn: Callable) -> Callable:
    return partial(parallelize_for_gloo, parallelize_fn=parallelize_fn)


def pipeline_torchtitan(model: nn.Module, **kwargs):
    """torchtitan's ``pipeline_llm``, its schedule behind :class:`MicrobatchListSchedule`."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    schedule, parts, has_first, has_last = pipeline_llm(model, **kwargs)
    return MicrobatchListSchedule(schedule), parts, has_first, has_last
