"""Distributed checkpoints of a pipeline rank's stages with torch.distributed.checkpoint.

The model's state is its own ``state_dict()`` on the rank's merged stage view (whole-model
keys, the model's state-dict hooks honoured) and the optimizer's is torch's
``get_optimizer_state_dict`` keyed by the same FQNs, so a checkpoint does not depend on the
layout that wrote it: DCP reshards on load into any pp × dp × tp and split.

Invariant: ``<path>`` is always the last complete checkpoint. Each save writes a fresh
``<path>.v<N>``; once every rank's data and DCP's ``.metadata`` exist, rank 0 writes a
fsynced ``.autopp-complete`` marker, switches the symlink ``<path>`` to it with one atomic
rename, and removes the other versions. A crash before the switch leaves ``<path>`` as it
was; :func:`load` names the incomplete version. A link rather than a manifest so that DCP's
own tools read ``<path>`` as a plain directory. The one step with a window: a real directory
at ``<path>`` (an older save) is moved to ``<path>.v0`` before the link appears."""

from __future__ import annotations

import logging
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger(__name__)
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    return state


def all_finite(state: dict) -> bool:
    """Whether every floating tensor (local shard) of ``state`` is finite, on every rank
    (one all-reduce of a flag, so all ranks agree)."""
    from autopp._compat.distributed import tree_leaves

    ok = True
    for t in tree_leaves(state):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            local = t.to_local() if hasattr(t, "to_local") else t
            if not bool(torch.isfinite(local).all()):
                ok = False
                break
    device = torch.device("cpu")
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):  # NCCL: device tensors
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag)
    return flag.item() == 0.0


_COMPLETE = ".autopp-complete"
_METADATA = ".metadata"  # DCP's, written by the coordinator after every rank's data


def _versions(path: str) -> list[tuple[int, str]]:
    """``(N, directory)`` of the ``<path>.v<N>`` directories beside ``path``, by N."""
    parent, base = os.path.split(os.path.abspath(path))
    out = []
    for name in os.listdir(parent or "."):
        if name.startswith(base + ".v") and name[len(base) + 2:].isdigit():
            out.append((int(name[len(base) + 2:]), os.path.join(parent, name)))
    return sorted(out)


def _is_complete(d: str) -> bool:
    """Whether ``d`` holds a whole checkpoint: a save's ``<path>.v<N>`` (N >= 1) carries the
    marker written after DCP's metadata; any other DCP directory (``.v0``: one moved aside
    by the first save, or written by other tools) has DCP's metadata, which DCP writes
    after every rank's data."""
    if _version_of(os.path.realpath(d)) >= 1:
        return os.path.exists(os.path.join(d, _COMPLETE))
    return os.path.exists(os.path.join(d, _METADATA))


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _switch(path: str, target: str) -> None:
    """Point ``path`` (a link, or nothing yet) at ``target`` with one atomic rename."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) and not os.path.islink(path):  # a real directory: see module doc
        os.replace(path, f"{path}.v0")
    link = f"{path}.link-{os.getpid()}"
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.basename(target), link)  # relative: the tree can move
    os.replace(link, path)
    _fsync_dir(parent)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         force: bool = False) -> None:
    """Write ``model`` (and ``optimizer``) state as the checkpoint ``path``; all ranks call it.

    A state with a NaN or inf anywhere (on any rank) is refused with a ValueError on every
    rank unless ``force``. ``path`` keeps naming the previous complete checkpoint until
    this one is complete, whenever the job dies (see the module doc).
    """
    state = _state(model, optimizer)
    if not force and not all_finite(state):
        raise ValueError(
            f"refusing to save a non-finite state (NaN or inf in the model or optimizer) to "
            f"{path}; the checkpoint there is untouched. Pass force=True to save it anyway.")
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # every rank lists before anyone writes (the barrier), so all agree on the new N
    n = max((v for v, _ in _versions(path)), default=0) + 1
    target = f"{path}.v{n}"
    _barrier()
    dcp.save(state, checkpoint_id=target)
    _barrier()
    if _is_rank0():
        with open(os.path.join(target, _COMPLETE), "w") as f:
            f.write(f"complete: every rank's data and DCP's {_METADATA} are written\n")
            f.flush()
            os.fsync(f.fileno())
        _switch(path, target)
        for v, d in _versions(path):
            if d != target:
                shutil.rmtree(d, ignore_errors=True)
        for leftover in (f"{path}.tmp", f"{path}.old"):  # an older autopp's protocol
            if os.path.isdir(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
        parent, base = os.path.split(path)
        for name in os.listdir(parent):  # links of saves killed before their switch
            if name.startswith(f"{base}.link-") and os.path.islink(os.path.join(parent, name)):
                os.remove(os.path.join(parent, name))
    _barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def checkpoint_to_read(path: str) -> str:
    """The directory :func:`load` reads for ``path``; raises a one-line error when ``path``
    is not a complete checkpoint, naming the last complete one beside it."""
    path = os.path.abspath(path)
    stem = path.rpartition(".v")[0] if path.rpartition(".v")[2].isdigit() else path
    beside = [d for _, d in _versions(stem)] + [f"{stem}.tmp", f"{stem}.old"]
    complete = [d for d in beside if os.path.isdir(d) and _is_complete(d)]
    pointed = os.path.realpath(stem) if os.path.islink(stem) else None
    if os.path.isdir(path) and _is_complete(path):
        newer = [d for n, d in _versions(stem) if pointed and n > _version_of(pointed)]
        if newer and path == stem:
            logger.warning("checkpoint %s: a save was interrupted (%s was not committed and "
                           "is ignored; the next save removes it); reading %s, the last "
                           "complete checkpoint", path, os.path.basename(newer[-1]),
                           os.path.basename(pointed))
        return path
    if os.path.isdir(path):
        last = (f"{stem} (-> {os.path.basename(pointed)})" if pointed and _is_complete(stem)
                else ", ".join(complete) or "none")
        raise ValueError(f"checkpoint {path} is an interrupted save (not complete); the last "
                         f"complete checkpoint is {last}")
    if complete:
        raise ValueError(f"no checkpoint at {path}: a save was interrupted; complete "
                         f"checkpoints beside it: {', '.join(complete)} (load one by its path)")
    partial = [os.path.basename(d) for d in beside if os.path.isdir(d)]
    if partial:
        raise ValueError(f"no checkpoint at {path}: its save was interrupted before it "
                         f"completed ({', '.join(partial)} incomplete), and no complete "
                         "checkpoint is beside it")
    raise FileNotFoundError(f"no checkpoint at {path}")


def _version_of(d: str) -> int:
    tail = d.rpartition(".v")[2]
    return int(tail) if tail.isdigit() else -1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read ``model`` (and ``optimizer``) state written by :func:`save`; all ranks call it.

    The optimizer must have been created over ``model``'s parameters; a stateful optimizer's
    state (AdamW's moments and step) is restored too, so training continues exactly. An
    interrupted save beside ``path`` is named in a warning; ``path`` itself incomplete or
    missing is a one-line error naming the last complete checkpoint
    (:func:`checkpoint_to_read`), on every rank, before any collective.
    """
    path = checkpoint_to_read(path)  # every rank checks before any collective
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    # Through load_state_dict, so the model's load hooks run (e.g. wq/wk/wv -> fused wqkv).
    model.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)
