"""Whether the stages after the first run the model's forward on the model's own inputs.

By default a later stage runs the forward on the activation it receives, given as the
model's input: right for a forward that only hands its input to the embedding. A forward
that reads the input itself (GPT-2 takes batch, length and positions from ``input_ids``)
would compute from the activation instead. The stage check calls each later stage with the
model's inputs as keywords too, and any torch function or tensor attribute applied to those
very tensors is a read; such a model's stages then take the model's inputs on every step.
Invariant: a forward that does not read its input computes the same either way, so it keeps
the default (no extra graph input)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autopp import tracing
from autopp.stage_split.build import model_input_keywords

__all__ = ["InputReads", "given_model_inputs", "model_inputs_note", "stage_keyword_inputs",
           "stages_read_model_inputs"]


class InputReads:
    """The stages as the stage check calls them (those after the first given the model's
    inputs ``first_inputs`` as keywords), and, once they have run, whether a forward read
    those inputs (:attr:`read`)."""

    def __init__(self, stages: Sequence[nn.Module], first_inputs: Sequence[torch.Tensor]):
        # tensors of their own: a read is found by identity, never by an equal tensor
        self._keywords = model_input_keywords(tuple(
            torch.empty(t.shape, dtype=t.dtype, device="meta") for t in first_inputs))
        self.read = False
        self.calls: list[Callable[..., Any]] = [
            stage if i == 0 else functools.partial(self._call, stage)
            for i, stage in enumerate(stages)]

    def _call(self, stage: nn.Module, *args: Any, **kwargs: Any) -> Any:
        mode = _Reads(self._keywords.values())
        with mode:
            out = stage(*args, **self._keywords, **kwargs)
        self.read = self.read or mode.read
        return out


class _Reads(TorchFunctionMode):
    """Notes whether any torch function (a tensor method or attribute included) is applied
    to one of ``tensors`` itself."""

    def __init__(self, tensors: Any):
        from autopp._compat.graph import tree_leaves  # torch's pytree (private); not at import

        super().__init__()
        self._leaves = tree_leaves
        self._ids = {id(t) for t in tensors}
        self.read = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.read:
            self.read = any(id(a) in self._ids for a in self._leaves((args, kwargs)))
        return func(*args, **kwargs)


@torch.no_grad()
def stages_read_model_inputs(stages: Sequence[nn.Module],
                             first_inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the forward of a stage after the first (``stages``: the whole model's, on
    meta, in order) reads the model's inputs (``first_inputs``: one microbatch's); the
    stages run once each, on meta. A stage that fails ends the run (the stage check names
    its error): False unless an earlier stage read them."""
    reads = InputReads(stages, first_inputs)
    x: tuple[Any, ...] = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta")
                               for t in first_inputs)
    for call in reads.calls:
        try:
            with tracing.on_meta():  # e.g. a MoE router's autocast, which meta refuses
                out = call(*x)
        except Exception:  # noqa: BLE001 - the stage check reports it
            break
        x = out if isinstance(out, tuple) else (out,)
    return reads.read


def given_model_inputs(keyword_inputs: Mapping[str, torch.Tensor],
                       inputs: Sequence[torch.Tensor], reads: bool) -> dict[str, torch.Tensor]:
    """The keyword inputs every stage takes: ``keyword_inputs`` and, when the stages
    ``reads`` the model's inputs, ``inputs`` by their keywords; sorted by name."""
    given = dict(keyword_inputs)
    if reads:
        given.update(model_input_keywords(inputs))
    return dict(sorted(given.items()))


def stage_keyword_inputs(stages: Sequence[nn.Module], inputs: Sequence[torch.Tensor],
                         n_microbatches: int, keyword_inputs: Mapping[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
    """The keyword inputs every stage of ``stages`` takes (:func:`given_model_inputs`), from
    the model's ``inputs`` and ``keyword_inputs`` for one step on one dp rank."""
    mb = tuple(torch.empty((t.shape[0] // n_microbatches, *t.shape[1:]), dtype=t.dtype,
                           device="meta") for t in inputs)
    return given_model_inputs(keyword_inputs, inputs, stages_read_model_inputs(stages, mb))


def model_inputs_note(inputs: Sequence[torch.Tensor]) -> str:
    """The line logged (and shown by the pipeline's ``describe()``) when the model's inputs
    go to every stage."""
    given = ", ".join(f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                      for name, t in model_input_keywords(inputs).items())
    line = (f"its forward reads its input (shapes, positions), so every stage runs it on the "
            f"model's inputs: {given} per step reach every stage as keyword inputs (from each "
            "rank's batch, nothing sent between stages)")
    logging.getLogger("autopp").info("%s", line)
    return line
