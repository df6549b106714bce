"""On-disk cache of stage sharding plans, so a restart does not solve again.

A plan is keyed by everything it depends on: the stage module's structure (module types,
parameter and buffer names, shapes, dtypes), the example input shapes and dtypes, the
sub-mesh shape and dim names, the device profile, the planner options, and the planner's
own source code. Ranks that plan
the same stage on one host take a file lock, so one of them solves and the others read its
result; ranks on other hosts solve the same deterministic problem themselves.

The directory is ``$AUTOPP_PLAN_CACHE`` if set, else ``~/.cache/autopp/plans``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopp.sharding import StagePlan


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPP_PLAN_CACHE", Path.home() / ".cache" / "autopp" / "plans"))


def _describe_tensor(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return ["tensor", list(t.shape), str(t.dtype)]
    return repr(t)


def _planner_source_hash() -> str:
    """Plans depend on the planner's code: a change to it invalidates the cache."""
    import autopp.sharding

    h = hashlib.sha256()
    for f in sorted(Path(autopp.sharding.__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def plan_key(
    module: nn.Module, example_inputs: Sequence[Any], mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str], options: dict[str, Any],
) -> str:
    """A stable hash of what a stage plan depends on."""
    desc = {
        "modules": [[n, type(m).__qualname__] for n, m in module.named_modules()],
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()],
        "inputs": [_describe_tensor(x) for x in example_inputs],
        "mesh": [list(mesh_shape), list(mesh_dim_names)],
        "options": {k: repr(v) for k, v in sorted(options.items())},
        "torch": torch.__version__,
        "planner": _planner_source_hash(),
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]


def cached_plan(key: str, solve: Callable[[], StagePlan]) -> tuple[StagePlan, bool]:
    """The plan stored under ``key``, or ``solve()``'s (stored for next time).

    Returns ``(plan, was_cached)``. One process per host solves a given key at a time.
    """
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{key}.json"
    with open(d / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists():
                return StagePlan.load(path), True
            plan = solve()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            plan.save(tmp)
            tmp.replace(path)
            return plan, False
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
