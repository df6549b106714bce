"""Rank functions of tests/test_every_rank_errors.py (importable by the forkserver)."""

from __future__ import annotations


def bad_inputs(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """What each rank raises for a layout its world cannot hold and for a checkpoint whose
    save was interrupted; then a barrier, which proves no rank was left inside a
    collective."""
    import os

    import torch.distributed as dist
    from torch import nn

    from autopp import build_world_mesh, checkpoint

    out = {}
    try:
        build_world_mesh(pp=2, dp=2, tp=1)
    except ValueError as e:
        out["mesh"] = str(e)
    if rank == 0:
        os.makedirs(os.path.join(ckpt_dir, "ckpt.v1"), exist_ok=True)  # never completed
    dist.barrier()
    try:
        checkpoint.load(os.path.join(ckpt_dir, "ckpt"), nn.Linear(2, 2))
    except ValueError as e:
        out["load"] = str(e)
    dist.barrier()
    return out
