"""A forward run on meta where some of its ops cannot run on meta.

The stage check (:func:`autopp.stage_split.validate.check_stage_forwards`) runs each stage's
forward on meta, so that a forward the stage cut cannot follow fails early, by name. Some
ops a real device runs have no meta form: data-dependent ops (``nonzero``, ``.item()``,
boolean indexing: a MoE layer's per-expert loop) and kernels whose meta function is
narrower than their CPU one (``_grouped_mm``'s meta function takes bf16 only). Refusing such
a model would refuse one that trains in plain torch.

So each op that fails on meta is run once more by its CPU kernel, on inputs of the same
shapes and dtypes whose values are zero (zero-stride, no memory; dense where the kernel
refuses zero strides), and its results are taken
back to meta (their shapes, strides and dtypes; scalars as they are). Invariant: an op that
runs on meta is never run on CPU, and an op that fails on CPU too raises its meta error, so
a genuine error (a shape mismatch) is still reported. What a run took from CPU is returned
(:class:`MetaRun`) for the caller to log. Values on meta are unknown, so where a forward's
shapes depend on values (which a pipeline, whose stages exchange fixed shapes, cannot run
anyway) the run follows the path zeros take.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autopp import tracing

__all__ = ["MetaRun", "run_on_meta"]


@dataclass(frozen=True, kw_only=True)
class MetaRun:
    """What :func:`run_on_meta` returns."""

    output: Any
    """The forward's output, on meta."""
    on_cpu: tuple[str, ...]
    """The ops (by name, each once, in first-run order) that meta could not run and that ran
    by their CPU kernel on zeros."""


def _zeros(t: Any, dense: bool) -> Any:
    """A meta tensor's CPU twin of zeros: zero-stride (no memory), or ``dense`` (its own
    strides, for kernels that refuse zero strides)."""
    if not (isinstance(t, torch.Tensor) and t.device.type == "meta"):
        return t
    if dense:
        return torch.zeros_like(t, device="cpu")
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def _to_meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.device.type != "meta":
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


@functools.cache
def _mode_class() -> type:
    """The dispatch mode (a class made on first use: ``import autopp`` stays light)."""
    from autopp._compat.distributed import TorchDispatchMode, tree_leaves

    class CpuWhereMetaCannot(TorchDispatchMode):
        """Runs each op as it is; one that raises on meta tensors is run by its CPU kernel
        on zeros of the same shapes (module docstring), or, failing that too, raises as on
        meta."""

        def __init__(self) -> None:
            super().__init__()
            self.on_cpu: dict[str, None] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            try:
                return func(*args, **kwargs)
            except (NotImplementedError, RuntimeError) as meta_error:
                if not any(isinstance(t, torch.Tensor) and t.device.type == "meta"
                           for t in tree_leaves((args, kwargs))):
                    raise
                out = _on_cpu(func, args, kwargs)
                if out is None:
                    raise meta_error from None
                self.on_cpu.setdefault(str(func))
                return _tree_map(_to_meta, out[0])

    return CpuWhereMetaCannot


def _tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    from autopp._compat.distributed import tree_map

    return tree_map(fn, tree)


def _on_cpu(func: Any, args: Any, kwargs: Any) -> tuple[Any] | None:
    """``(func's CPU result on zeros,)``, or None when the CPU kernel refuses them too."""
    for dense in (False, True):
        cpu_args, cpu_kwargs = _tree_map(lambda t: _zeros(t, dense), (args, kwargs))
        try:
            return (func(*cpu_args, **cpu_kwargs),)
        except Exception:  # noqa: BLE001 - the meta error is the one reported
            continue
    return None


@torch.no_grad()
def run_on_meta(fn: Callable[..., Any], *args: Any) -> MetaRun:
    """``fn(*args)`` on meta, under the model adapters' tracing contexts
    (:func:`autopp.tracing.on_meta`), each op meta cannot run run on CPU on zeros."""
    mode = _mode_class()()
    with tracing.on_meta(), mode:
        out = fn(*args)
    return MetaRun(output=out, on_cpu=tuple(mode.on_cpu))
