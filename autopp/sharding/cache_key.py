"""The plan cache's keys: a stable hash of what a plan depends on.

Both kinds of entry (a stage's :class:`~autopp.sharding.StagePlan`, a whole
:class:`~autopp.plan.value.PipelinePlan`) hash their own description together with what
every plan depends on: torch's and torchtitan's versions, the tracing settings and the
planning code (:func:`planner_source_files`). The stage key is made here, from
:meth:`autopp.sharding.request.StageRequest.key`; the store itself is
:mod:`autopp.plan.cache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopp import tracing


def _describe_tensor(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return ["tensor", list(t.shape), str(t.dtype)]
    return repr(t)


def planner_source_files() -> list[Path]:
    """The code a plan depends on: the sharding planner (``sharding/``, its subfolders
    included), tracing (``tracing/``), the pipeline plan and its maker (``plan/``,
    ``tied.py``), the ops' rules (``ops/``), the recompute rules (``graph/``), the stage split
    (``stage_split/``), the model adapters (``adapters/``), the fixed memory terms and the
    collectives' windows (``schedules/``: the simulator and the action lists it runs; a
    pipeline key holds the windows' inputs, not their values)."""
    root = Path(__file__).parent.parent
    folders = ("sharding", "tracing", "plan", "ops", "graph", "stage_split", "adapters")
    schedules = ("memory_terms.py", "comm_windows.py", "simulate.py", "actions.py")
    return [*(f for d in folders for f in sorted((root / d).rglob("*.py"))), root / "tied.py",
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
    """A profile as a key holds it: its numbers, not its name (re-registering or
    re-measuring a profile under one name must not reuse plans priced at the old speeds)."""
    from autopp.profiles.devices import DeviceProfile
    from autopp.profiles.lookup import get_profile

    if isinstance(profile, DeviceProfile):
        return dataclasses.asdict(profile)
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
    bytecode) and of the file the class is defined in (the helpers a forward calls): a
    changed forward, or a changed helper beside it, gets a new key. (A helper in another
    file is not seen: a plan that no longer applies is evicted, :func:`autopp.plan.cache.evict`.)"""
    return sorted({_class_forward_code(type(m)) for m in module.modules()})


def hash_key(desc: dict[str, Any]) -> str:
    """``desc`` (JSON values) with the versions, the planning code's hash and the tracing
    settings, hashed."""
    desc = {**desc, "torch": torch.__version__, "torchtitan": _version("torchtitan"),
            "planner": _planner_source_hash(), "adapters": tracing.current_settings()}
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
    return hash_key({
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
    :meth:`autopp.plan.make.PipelineRequest.key`; its options' profile is hashed by its
    numbers), torch's and torchtitan's versions and the planning code."""
    opts = desc.get("options")
    if isinstance(opts, dict) and "profile" in opts:
        desc = {**desc, "options": {**opts, "profile": profile_numbers(opts["profile"])}}
    return "pipeline-" + hash_key({"pipeline": desc})
