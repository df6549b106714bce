"""Small helpers the ranks' workers share: a tensor made whole, a rank's own values, a dp
rank's rows of a batch, and FSDP2 per block as a user's ``parallelize`` applies it. ``full`` of a DTensor is a collective: every rank of its mesh calls
it alike (the workers gather every gradient on every rank, in the same order)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered over its mesh, any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t``, without communication."""
    return t.to_local() if isinstance(t, DTensor) else t


def dp_rows(mesh, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's equal share of each tensor's rows (dim 0, the batch) by its coordinate on
    the "dp" dim of a ("pp", "dp", "tp") world mesh."""
    dp_rank, dp = mesh.get_coordinate()[1], mesh.shape[1]
    return tuple(t[dp_rank * (t.shape[0] // dp):(dp_rank + 1) * (t.shape[0] // dp)]
                 for t in tensors)


def fsdp_per_block(stage: torch.nn.Module, blocks, dp_mesh) -> torch.nn.Module:
    """FSDP2 over ``dp_mesh`` on each of ``blocks`` and then on the stage root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(stage, mesh=dp_mesh)
    return stage
