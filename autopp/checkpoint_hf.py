"""Hugging Face checkpoints (``save_pretrained`` directories of safetensors) into and out of a
pipeline, through torch.distributed.checkpoint's ``HuggingFaceStorageReader`` / ``Writer``.

Keys are whole-model FQNs on both sides (a transformers model's parameter names are its
safetensors keys), so a directory loads into any split and layout: each rank asks DCP for
the parameters its stages hold, in their placements, and the reader reads each rank's
slices of each tensor from the safetensors files, one tensor at a time. A parameter tied
between stages is one key under its first FQN, as transformers saves tied weights.
Saving writes every rank's shards and consolidates them into full tensors in
safetensors files (``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``),
with the model's config beside them when given, which ``from_pretrained`` loads.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from autopp.checkpoint import all_finite


def load_pretrained(path: str | os.PathLike, model: nn.Module) -> None:
    """Load the safetensors of the ``save_pretrained`` directory ``path`` into ``model`` (a
    rank's merged stage view) by FQN; collective. A key the model needs and the directory
    lacks is an error naming it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; pass a save_pretrained directory")
    state = model.state_dict()
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    model.load_state_dict(state)  # the model's load hooks run


def save_pretrained(path: str | os.PathLike, model: nn.Module, config: Any = None) -> None:
    """Write ``model``'s state (every rank's shards, consolidated into full tensors) as
    safetensors under ``path``, and ``config.save_pretrained(path)`` on rank 0 when a
    config is given; collective."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if not all_finite(state):
        raise ValueError(f"the model state is not finite (NaN or inf); not saved to {path}")
    writer = dcp.HuggingFaceStorageWriter(path, save_distributed=True,
                                          enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if config is not None and rank0:
        config.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
