"""Distributed checkpoints of a pipeline rank's stages with torch.distributed.checkpoint.

The model's state is its own ``state_dict()`` on the rank's merged stage view (whole-model
keys, DTensors where sharded, the model's state-dict hooks honoured, e.g. torchtitan's fused
QKV saved as wq/wk/wv); the optimizer's is torch's ``get_optimizer_state_dict`` keyed by the
same FQNs. A checkpoint is therefore independent of the layout that wrote it: DCP reshards on
load into any pp × dp × tp and any split. Replicated tensors (the same key on several ranks)
are written once.
"""

from __future__ import annotations

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
    flag = torch.tensor([0.0 if ok else 1.0])
    if dist.is_initialized():
        dist.all_reduce(flag)
    return flag.item() == 0.0


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         force: bool = False) -> None:
    """Write ``model`` (and ``optimizer``) state to the directory ``path``; all ranks call it.

    A state with a NaN or inf anywhere (on any rank) is refused with a ValueError on every
    rank unless ``force``. The checkpoint is written to ``<path>.tmp`` first and renamed
    into place when every rank is done, so a crash or a refusal never damages the
    checkpoint already at ``path``.
    """
    state = _state(model, optimizer)
    if not force and not all_finite(state):
        raise ValueError(
            f"refusing to save a non-finite state (NaN or inf in the model or optimizer) to "
            f"{path}; the checkpoint there is untouched. Pass force=True to save it anyway.")
    tmp = f"{path}.tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    _barrier()
    dcp.save(state, checkpoint_id=tmp)
    _barrier()
    if rank0:
        old = f"{path}.old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read ``model`` (and ``optimizer``) state written by :func:`save`; all ranks call it.

    The optimizer must have been created over ``model``'s parameters; a stateful optimizer's
    state (AdamW's moments and step) is restored too, so training continues exactly.
    """
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    # Through load_state_dict, so the model's load hooks run (e.g. wq/wk/wv -> fused wqkv).
    model.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)
