"""Rank functions of tests/pipeline/test_every_rank_errors.py (importable by the forkserver)."""

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


def slow_rank0(rank: int, world_size: int) -> dict:
    """The default group times out after 3 s; rank 0 works 6 s while the others wait: by
    ``broadcast_from_rank0`` (its own long-timeout group) they get the value, and rank 0's
    error; the same wait on the default group (the control) times out."""
    import datetime
    import time

    import torch.distributed as dist

    from autopp._compat.distributed import set_pg_timeout
    from autopp.plan.rank0 import broadcast_from_rank0

    set_pg_timeout(datetime.timedelta(seconds=3))
    out: dict = {}

    def slow():
        time.sleep(6)
        return {"plan": "made on rank 0"}

    t0 = time.monotonic()
    out["value"] = broadcast_from_rank0(slow, what="planning the pipeline")
    out["waited_s"] = time.monotonic() - t0

    def fails():
        raise ValueError("no layout of 2 devices fits")

    try:
        broadcast_from_rank0(fails, what="searching layouts")
    except ValueError as e:
        out["error"] = " ".join([str(e), *getattr(e, "__notes__", [])])
    # the control: waiting for the same 6 s on the default group times out at 3 s
    box = [None]
    t0 = time.monotonic()
    try:
        if rank == 0:
            time.sleep(6)
            box = ["late"]
        dist.broadcast_object_list(box, src=0)
        out["control"] = "no timeout"
    except RuntimeError as e:
        out["control"] = f"timed out after {time.monotonic() - t0:.0f} s: {str(e)[:80]}"
    return out
