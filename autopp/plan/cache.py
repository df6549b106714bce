"""On-disk cache of plans, so a restart does not solve again.

Two kinds of entries, each keyed by everything it depends on:

- a stage's :class:`~autopp.sharding.StagePlan` (:func:`plan_key`, :func:`cached_plan`): the
  stage module's structure (module types, parameter and buffer names, shapes, dtypes), the
  example input shapes and dtypes, the sub-mesh shape and dim names, the device profile, the
  planner options;
- a whole :class:`~autopp.plan.value.PipelinePlan` (:func:`pipeline_plan_key`,
  :func:`cached_pipeline_plan`): the model's fingerprint, the split and stage placement, the
  mesh, schedule, microbatches, input shapes and planner options (without estimates).

Both keys also hold torch's version and the hash of the planning code
(:func:`planner_source_files`: the sharding planner, and the code that plans boundaries,
loss placement and tied parameters). Processes on one host that need the same entry take a
file lock, so one of them solves and the others read its result.

The directory is ``$AUTOPP_PLAN_CACHE`` if set, else ``~/.cache/autopp/plans``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from autopp.disk_cache import cached_file

if TYPE_CHECKING:
    from autopp.plan.value import PipelinePlan
    from autopp.sharding import StagePlan

T = TypeVar("T")
logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPP_PLAN_CACHE", Path.home() / ".cache" / "autopp" / "plans"))


def _describe_tensor(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return ["tensor", list(t.shape), str(t.dtype)]
    return repr(t)


def planner_source_files() -> list[Path]:
    """The code a plan depends on: the sharding planner (``autopp/sharding/``), the pipeline
    plan and its maker (``autopp/plan/``, ``tied.py``), the ops' rules (``autopp/ops/``), the
    recompute rules the memory row uses (``autopp/graph/``), the stage split
    (``autopp/stage_split/``), the model adapters (``autopp/adapters/``, whose settings are
    in the key too), the fixed memory terms taken off the budgets
    (``autopp/schedules/memory_terms.py``) and what the once-per-step collectives' windows
    are read off (``autopp/schedules/comm_windows.py``, the simulator and the action
    lists it runs: a whole pipeline's key holds the windows' inputs, not their values)."""
    root = Path(__file__).parent.parent
    folders = ("sharding", "plan", "ops", "graph", "stage_split", "adapters")
    schedules = ("memory_terms.py", "comm_windows.py", "simulate.py", "actions.py")
    return [*(f for d in folders for f in sorted((root / d).glob("*.py"))), root / "tied.py",
            *(root / "schedules" / f for f in schedules)]


def _planner_source_hash() -> str:
    """Plans depend on the planning code: a change to it invalidates the cache."""
    h = hashlib.sha256()
    for f in planner_source_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _version(dist_name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "absent"


def profile_numbers(profile: Any) -> Any:
    """A profile as the key holds it: its numbers, not its name (re-registering or
    re-measuring a profile under one name must not reuse plans priced at the old speeds)."""
    import dataclasses

    from autopp.profiles.lookup import get_profile

    if profile == "measure":  # resolving it would measure the machine; callers resolve first
        return profile
    try:
        return dataclasses.asdict(get_profile(profile))
    except (ValueError, TypeError):  # not a resolvable profile: as it was given
        return repr(profile)


_FORWARD_CODE: dict[type, str] = {}


def _class_forward_code(cls: type) -> str:
    if cls not in _FORWARD_CODE:
        fwd = getattr(cls, "forward", None)
        try:
            text = inspect.getsource(fwd)
        except (OSError, TypeError):
            code = getattr(fwd, "__code__", None)
            text = repr((code.co_code, code.co_consts)) if code is not None else cls.__qualname__
        try:  # the helpers its forward calls: the whole file the class is defined in
            text += Path(inspect.getsourcefile(cls) or "").read_text()
        except (OSError, TypeError):
            pass
        _FORWARD_CODE[cls] = f"{cls.__module__}.{cls.__qualname__}:" + hashlib.sha256(
            text.encode()).hexdigest()[:12]
    return _FORWARD_CODE[cls]


def forward_code(module: nn.Module) -> list[str]:
    """A hash of each distinct module class's ``forward`` in ``module`` (its source, or its
    bytecode where the source is not available) and of the file the class is defined in
    (the helper functions a forward calls): a changed forward, or a changed helper beside
    it, gets a new key. (A helper in another file is not seen: a plan that then no longer
    applies is evicted, see :func:`evict`.)"""
    return sorted({_class_forward_code(type(m)) for m in module.modules()})


def _hash(desc: dict[str, Any]) -> str:
    from autopp import adapters

    desc = {**desc, "torch": torch.__version__, "torchtitan": _version("torchtitan"),
            "planner": _planner_source_hash(), "adapters": adapters.settings()}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]


def plan_key(
    module: nn.Module, example_inputs: Sequence[Any], mesh_shape: Sequence[int],
    mesh_dim_names: Sequence[str], options: dict[str, Any],
) -> str:
    """A stable hash of what a stage plan depends on: the module's structure and forward
    code, its inputs, the mesh, the options (a profile by its numbers), the planning code,
    torch's and torchtitan's versions, the tracing settings."""
    if "profile" in options:
        options = {**options, "profile": profile_numbers(options["profile"])}
    return _hash({
        "modules": [[n, type(m).__qualname__] for n, m in module.named_modules()],
        "forward": forward_code(module),
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in module.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers()],
        "inputs": [_describe_tensor(x) for x in example_inputs],
        "mesh": [list(mesh_shape), list(mesh_dim_names)],
        "options": {k: repr(v) for k, v in sorted(options.items())},
    })


def pipeline_plan_key(desc: dict[str, Any]) -> str:
    """A stable hash of what a whole pipeline plan depends on (``desc``: JSON values, see
    :func:`autopp.plan.make.plan_whole_pipeline`; its options' profile is hashed by its
    numbers), torch's and torchtitan's versions and the planning code."""
    opts = desc.get("options")
    if isinstance(opts, dict) and "profile" in opts:
        desc = {**desc, "options": {**opts, "profile": profile_numbers(opts["profile"])}}
    return "pipeline-" + _hash({"pipeline": desc})


def _cached(key: str, solve: Callable[[], T], load: Callable[[Path], T],
            save: Callable[[T, Path], None]) -> tuple[T, bool]:
    return cached_file(cache_dir(), key, solve, load, save)


def evict(keys: Sequence[str], why: str) -> list[Path]:
    """Remove the entries ``keys`` from the plan cache (a plan that failed to apply: the
    next planning solves them again); logs a warning naming each entry removed and ``why``.
    Returns the files removed (an entry already gone, or a read-only cache, is skipped)."""
    removed = []
    for key in dict.fromkeys(keys):
        path = cache_dir() / f"{key}.json"
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as err:
            logger.warning("plan cache entry %s could not be evicted (%s)", path, err)
            continue
        removed.append(path)
    if removed:
        logger.warning("evicted %d plan cache entr%s (%s): %s", len(removed),
                       "y" if len(removed) == 1 else "ies", why,
                       ", ".join(p.name for p in removed))
    return removed


def cached_plan(key: str, solve: Callable[[], StagePlan]) -> tuple[StagePlan, bool]:
    """The stage plan stored under ``key``, or ``solve()``'s (stored for next time).

    Returns ``(plan, was_cached)``. One process per host solves a given key at a time.
    """
    from autopp.sharding import StagePlan

    return _cached(key, solve, StagePlan.load, lambda p, path: p.save(path))


def cached_pipeline_plan(key: str, solve: Callable[[], PipelinePlan]
                         ) -> tuple[PipelinePlan, bool]:
    """The whole pipeline plan stored under ``key`` (:func:`pipeline_plan_key`), or
    ``solve()``'s; as :func:`cached_plan`."""
    from autopp.plan.value import PipelinePlan

    return _cached(key, solve, PipelinePlan.load, lambda p, path: p.save(path))
