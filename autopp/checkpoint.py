"""Distributed checkpoints of a pipeline rank's stages with torch.distributed.checkpoint.

The model's state is its own ``state_dict()`` on the rank's merged stage view (whole-model
keys, DTensors where sharded, the model's state-dict hooks honoured, e.g. torchtitan's fused
QKV saved as wq/wk/wv); the optimizer's is torch's ``get_optimizer_state_dict`` keyed by the
same FQNs. A checkpoint is therefore independent of the layout that wrote it: DCP reshards on
load into any pp × dp × tp and any split. Replicated tensors (the same key on several ranks)
are written once.
"""

from __future__ import annotations

import torch
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


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``model`` (and ``optimizer``) state to the directory ``path``; all ranks call it."""
    dcp.save(_state(model, optimizer), checkpoint_id=path)


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
