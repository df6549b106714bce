"""What torchtitan 0.3.0's Trainer needs from its environment that this one lacks.

Each function changes a few module globals for one training job and returns the function
that puts them back (:class:`~autopp.integrations.torchtitan.trainer.AutoppTrainer` calls
them in its constructor and undoes them in ``close()``).

CPU processes: torchtitan picks its device once, at import (``"cuda"`` even without an
accelerator), and several modules copy it; :func:`use_cpu_device` points those globals at
``"cpu"`` and :class:`CpuDeviceModule` (the few ``torch.cuda``-style calls the Trainer makes,
answered for a CPU process). torch 2.13: torchtitan calls ``torch.distributed.set_timeout``,
which torch 2.13 lacks; :func:`use_set_timeout` provides it from ``_set_pg_timeout``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: torchtitan modules holding their own copy of ``device_type`` / ``device_module``.
_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
)


def _proc_kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


@dataclass(frozen=True, slots=True)
class _Properties:
    name: str
    total_memory: int


class CpuDeviceModule:
    """The ``torch.cuda`` calls torchtitan's Trainer makes, for a CPU process."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device=None) -> _Properties:
        return _Properties("CPU", max(_proc_kib("/proc/meminfo", "MemTotal"), 1) * 1024)

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        """Peak resident set size of this process (VmHWM) as the active and reserved peak."""
        peak = _proc_kib("/proc/self/status", "VmHWM") * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        """Reset VmHWM to the current resident set (Linux ``clear_refs`` 5), when allowed."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def needs_cpu_device() -> bool:
    """True when torchtitan chose "cuda" but this process has no CUDA device."""
    from torchtitan.tools import utils

    return utils.device_type == "cuda" and not torch.cuda.is_available()


def use_cpu_device() -> Callable[[], None]:
    """Point torchtitan's device globals at the CPU; returns the function that restores them."""
    saved: list[tuple[object, str, object]] = []
    for name in _MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        for attr, value in (("device_type", "cpu"), ("device_module", CpuDeviceModule)):
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)

    def restore() -> None:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
        saved.clear()

    return restore


def use_set_timeout() -> Callable[[], None]:
    """Give ``torch.distributed`` the ``set_timeout(timeout, group)`` torchtitan calls, when
    it lacks one (torch 2.13); returns the function that removes it again."""
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return lambda: None
    from autopp._compat.distributed import set_pg_timeout

    dist.set_timeout = set_pg_timeout

    def restore() -> None:
        if getattr(dist, "set_timeout", None) is set_pg_timeout:
            del dist.set_timeout

    return restore
