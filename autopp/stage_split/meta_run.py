"""A forward run on meta where some of its ops cannot run on meta.

The stage check runs each stage's forward on meta so that a forward the cut cannot follow
fails early, by name. Some ops have no meta form (data-dependent ones: ``nonzero``,
``.item()``, boolean indexing) or a narrower one than on CPU (``_grouped_mm``'s takes bf16
only); refusing those would refuse models that train in plain torch. So an op that fails on
meta runs once more by its CPU kernel on zeros of the same shapes (zero-stride where the
kernel takes it), and its results' shapes go back to meta; what ran on CPU is returned
(:class:`MetaRun`) for the caller to log. Invariant: an op that runs on meta never runs on
CPU, and one that fails on CPU too raises its meta error, so a genuine mismatch is reported.
Where shapes depend on values, the run follows the path zeros take."""

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
