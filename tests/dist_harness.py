"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

Tests group many checks into one launch: process start-up (imports) dominates on small
machines. The worker must be a module-level function (picklable for spawn) ``fn(rank, world_size, *args)``; its
return value is pickled back to the parent, which makes the assertions.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Plain bytes: tensors put on a torch.multiprocessing queue as shared memory would
        # vanish when this process exits before the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report the worker's traceback to the parent test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed.pipelining", "torchtitan.models.llama3", "autopp",
            "tests.models", "tests.pipeline_workers"]


def _context():
    """forkserver with the heavy imports preloaded: each worker starts as a fork of a clean
    server process (seconds faster than spawn on a 2-core machine), and never of the pytest
    process, whose state (e.g. a HiGHS solver thread pool left by a planner test) a plain
    fork would inherit half-broken. AUTOPP_TEST_START=spawn|fork overrides."""
    method = os.environ.get("AUTOPP_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Spawn ``world_size`` gloo processes running ``fn``; return their results by rank."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        rank, status, out = queue.get()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(out), weights_only=False)
        else:
            errors.append(f"--- rank {rank} ---\n{out}")
            break
    if errors:
        for p in procs:
            p.kill()
        raise RuntimeError("worker failed:\n" + "\n".join(errors))
    for p in procs:
        p.join(timeout)
    return [results[r] for r in range(world_size)]
