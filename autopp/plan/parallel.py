"""Per-stage work on forked worker processes: a pipeline's stages planned under their
budgets, and the dry run's costing of each planned stage.

Once the boundaries are chosen, each stage's budgeted plan depends only on its own inputs,
and the solves run on one core each. :func:`map_stages` runs such work on this process and
``workers - 1`` forked children, each taking the next stage from a shared counter, the end
stages first (their polishes are the longest); results come back through pipes drained by
threads, and plans go into the plan cache as this process would write them. Invariant: what a
child does not deliver (it raised, died, or hung for :data:`HUNG_S`) this process does
itself, so the results, and the first error in stage order, are the sequential loop's.

It forks only when nothing a fork could break is held: no CUDA context and no process group
but the fake one (a job's rank 0 beside real communicators plans in sequence). Children
reset HiGHS's thread pool, run torch on one thread and leave by ``os._exit``.
``AUTOPP_PLAN_WORKERS`` sets the processes (1: in sequence); default one per core, at most 8."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAX_WORKERS = 8

HUNG_S = 120.0
"""A child that sends nothing and uses no CPU for this long is taken for hung: it is
stopped and this process plans what it had not delivered."""

_POLL_S = 5.0


def plan_workers(n_stages: int) -> int:
    """How many processes plan ``n_stages`` stages here (1: this one alone)."""
    env = os.environ.get("AUTOPP_PLAN_WORKERS")
    if env:
        try:
            want = int(env)
        except ValueError:
            raise ValueError(f"AUTOPP_PLAN_WORKERS={env!r}: a number of processes (1: plan "
                             "the stages in sequence)") from None
    else:
        want = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1, MAX_WORKERS)
    return max(1, min(want, n_stages)) if _fork_safe() else 1


def _fork_safe() -> bool:
    import torch
    import torch.distributed as dist

    if not hasattr(os, "fork") or torch.cuda.is_initialized():
        return False
    return not dist.is_initialized() or dist.get_backend() == "fake"


def map_stages(plan_of: Callable[[int], Any], n: int, *, workers: int | None = None,
               progress: Callable[[int, int, float], None]
               = lambda done, n, elapsed: None) -> tuple[Any, ...]:
    """``(plan_of(0), ..., plan_of(n - 1))``, on up to ``workers`` processes (None:
    :func:`plan_workers`); ``plan_of`` may be any per-stage work whose result pickles
    (what a stage's planning took rides with its result). ``progress(done, n,
    elapsed_s)`` after each stage this process plans or receives."""
    workers = plan_workers(n) if workers is None else workers
    t0 = time.perf_counter()
    if workers <= 1:
        out = []
        for s in range(n):
            out.append(plan_of(s))
            progress(s + 1, n, time.perf_counter() - t0)
        return tuple(out)
    import multiprocessing
    import threading

    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("i", 0)

    # the end stages first: they hold the distinct units (embedding, head and loss), whose
    # polishes are the longest solves
    order = [0, n - 1, *range(1, n - 1)]

    def take() -> int:
        with counter.get_lock():
            k = counter.value
            counter.value += 1
        return order[k] if k < n else n

    plans: dict[int, Any] = {}
    lock = threading.Lock()

    def receive(proc: Any, recv: Any) -> None:  # a child's plans as they come (a full
        cpu, still = _cpu_ticks(proc.pid), 0.0   # pipe would stop the child)
        while True:
            if not recv.poll(_POLL_S):
                now = _cpu_ticks(proc.pid)
                still = still + _POLL_S if now is not None and now == cpu else 0.0
                cpu = now
                if still >= HUNG_S:  # alive, silent and using no CPU: hung
                    logger.warning("a stage-planning process (pid %d) used no CPU for %.0f s;"
                                   " stopped, its stages are planned here", proc.pid, still)
                    proc.kill()
                    break
                continue
            try:
                s, plan = recv.recv()
            except EOFError:
                break
            with lock:
                plans[s] = plan
                progress(len(plans), n, time.perf_counter() - t0)
        proc.join()
        if proc.exitcode != 0:
            logger.warning("a stage-planning process exited with code %s; what it did not "
                           "plan is planned here", proc.exitcode)

    children = []
    for _ in range(workers - 1):  # every fork before any thread of ours starts
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(plan_of, n, take, send), daemon=True)
        proc.start()
        send.close()
        children.append((proc, recv))
    readers = [threading.Thread(target=receive, args=child, daemon=True)
               for child in children]
    for reader in readers:
        reader.start()
    logger.info("planning %d stages on %d processes (AUTOPP_PLAN_WORKERS=1: in sequence)",
                n, workers)
    while (s := take()) < n:
        try:
            plan = plan_of(s)
        except Exception:  # noqa: BLE001 - planned again below, in order, to raise there
            continue
        with lock:
            plans[s] = plan
            progress(len(plans), n, time.perf_counter() - t0)
    for reader in readers:
        reader.join()
    missing = [s for s in range(n) if s not in plans]
    for s in missing:  # a child's failure (or this process's): the error, in stage order
        plans[s] = plan_of(s)
        progress(len(plans), n, time.perf_counter() - t0)
    return tuple(plans[s] for s in range(n))


def _cpu_ticks(pid: int) -> int | None:
    """CPU time (user + system, clock ticks) process ``pid`` has used; None where /proc
    cannot say (then a child is never taken for hung)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _child(plan_of: Callable[[int], Any], n: int, take: Callable[[], int], send: Any
           ) -> None:
    code = 0
    try:
        highs = sys.modules.get("autopp.sharding.ilp.highs")  # not imported: HiGHS never ran
        if highs is not None:
            highs.after_fork()
        # no intra-op thread pool: the parent's OpenMP pool is not copied by the fork (GNU
        # libgomp can hang in a forked child's first parallel region), the work here is on
        # meta tensors and small arrays, and the processes already use every core
        import torch

        torch.set_num_threads(1)
        while (s := take()) < n:
            try:
                plan = plan_of(s)
            except Exception:  # noqa: BLE001 - the parent plans it again and raises
                continue
            send.send((s, plan))
    except BaseException:  # noqa: BLE001 - the parent plans what is missing
        code = 1
    finally:
        send.close()
        os._exit(code)
