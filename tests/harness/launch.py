"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

Tests group many checks into one launch: process start-up (imports) dominates on small
machines. The worker must be a module-level function (picklable) ``fn(rank, world_size,
*args)``; its return value is pickled back to the parent, which makes the assertions.

Every launch has a deadline (``timeout``, seconds for the whole launch; ``work_timeout``,
optional, seconds from the moment every rank has joined the process group, so a deadline
meant for the work does not also have to cover start-up on a loaded machine). A rank that raises,
dies without reporting (a segfault, ``os._exit``) or is still running at the deadline (a
deadlock: a rank that skipped a collective) ends the launch: every rank is killed and the
error shows each rank's last lines of output (each rank writes its stdout and stderr to a
log file of its own) and its state, so a hang fails in bounded time with the evidence.
"""

from __future__ import annotations

import faulthandler
import io
import math
import os
import queue as queue_mod
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

#: Lines of each rank's output shown when a launch fails.
TAIL_LINES = 15
#: Lines shown of a rank killed by a signal (its faulthandler stacks, every thread's).
CRASH_LINES = 200


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
           log_dir: str) -> None:
    # this rank's stdout and stderr (Python's and the C++ libraries') go to its own log
    log = open(Path(log_dir) / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # a crash in native code (a segfault, an abort) writes every thread's Python stack to
    # the log, so the launch's error shows where the rank died, not "(no output)"
    faulthandler.enable(file=log, all_threads=True)
    import logging

    import torch
    import torch.distributed as dist

    from autopp._compat import gloo

    # in the rank's log: how long it waited for rank 0, and rank 0's pipeline plans
    # (solved or read from the plan cache)
    for name in ("autopp.plan.rank0", "autopp.plan.make"):
        shown = logging.getLogger(name)
        shown.setLevel(logging.INFO)
        shown.addHandler(logging.StreamHandler(log))

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    gloo.install()  # one worker thread per gloo group, as autopp gives a user's ranks
    try:
        # rendezvous through a file of this launch's own (not a TCP port picked earlier,
        # which a launch running beside it could have picked too)
        dist.init_process_group("gloo", init_method=f"file://{log_dir}/rendezvous", rank=rank,
                                world_size=world_size)
        queue.put((rank, "started", None))
        t0 = time.perf_counter()
        profile_dir = os.environ.get("AUTOPP_TEST_PROFILE")
        if profile_dir:  # each rank's cProfile of its work, for finding a launch's time
            import cProfile

            with cProfile.Profile() as prof:
                out = fn(rank, world_size, *args)
            prof.dump_stats(Path(profile_dir) / f"rank{rank}.prof")
        else:
            out = fn(rank, world_size, *args)
        t1 = time.perf_counter()
        # Plain bytes: tensors put on a torch.multiprocessing queue as shared memory would
        # vanish when this process exits before the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        data = buf.getvalue()
        t2 = time.perf_counter()
        queue.put((rank, "ok", data))
        print(f"[harness] worker {t1 - t0:.1f} s; result {len(data) / 2**20:.1f} MiB serialised "
              f"in {t2 - t1:.2f} s, queued in {time.perf_counter() - t2:.2f} s", flush=True)
    except BaseException:  # report the worker's traceback to the parent test
        tb = traceback.format_exc()
        print(tb, flush=True)
        queue.put((rank, "error", tb))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed.pipelining", "torchtitan.models.llama3", "autopp",
            "tests.harness.models", "tests.harness.workers.pipeline", "tests.harness.rank_preload"]


def context():
    """forkserver with the heavy imports preloaded: each worker starts as a fork of a clean
    server process (seconds faster than spawn on a 2-core machine), and never of the pytest
    process, whose state (e.g. a HiGHS solver thread pool left by a planner test) a plain
    fork would inherit half-broken. AUTOPP_TEST_START=spawn|fork overrides."""
    method = os.environ.get("AUTOPP_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "  (no output)"
    return "\n".join(f"  | {line}" for line in lines[-n:]) or "  (no output)"


def ships_tensors(mesh: Any) -> bool:
    """Whether this rank returns its stages' full tensors (gradients) to the test: the first
    rank of its stage, at coordinate 0 on every mesh dim but the first ("pp"). The other
    ranks of a stage gather the same full tensors with the same collectives, so they return
    only their norms (:func:`tests.harness.parity.norms`), which the tests compare too: eight full
    copies of a model's gradients made each rank's result 360–410 MiB in the MoE test (4–6.5 s
    to serialise a rank, and the parent reads them all)."""
    return all(c == 0 for c in mesh.get_coordinate()[1:])


class LaunchError(RuntimeError):
    """A launch that did not finish: a rank failed, died or missed the deadline."""


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600,
                 work_timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return their
    results by rank. Raises :class:`LaunchError` (every rank killed, each rank's last lines
    shown) when a rank raises, exits without a result (a crash in native code included: it is
    never launched again), the launch passes ``timeout``, or the work passes
    ``work_timeout`` counted from when every rank joined the process group."""
    return _launch(fn, world_size, args, timeout, work_timeout)


def _launch(fn: Callable, world_size: int, args: tuple, timeout: float,
            work_timeout: float | None = None) -> list[Any]:
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="autopp-ranks-"))
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, str(log_dir)),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    started: set[int] = set()
    work_deadline = math.inf
    failure: str | None = None
    while len(results) < world_size and failure is None:
        try:
            rank, status, out = queue.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)]
            if dead:
                failure = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} " \
                          "without a result"
            elif time.monotonic() > min(deadline, work_deadline):
                waiting = [r for r in range(world_size) if r not in results]
                what = (f"{timeout:.0f} s" if time.monotonic() > deadline else
                        f"{work_timeout:.0f} s after every rank started")
                failure = (f"deadline of {what} passed; ranks {waiting} still "
                           "running (a deadlock: e.g. a rank that skipped a collective)")
            continue
        if status == "started":
            started.add(rank)
            if len(started) == world_size and work_timeout is not None:
                work_deadline = time.monotonic() + work_timeout
        elif status == "ok":
            results[rank] = torch.load(io.BytesIO(out), weights_only=False)
        else:
            failure = f"rank {rank} raised:\n{out}"
    if failure is not None:
        # a rank that crashed makes its peers fail too (a closed connection): give it the
        # moment to exit, so the error names the crash
        time.sleep(1.0)
        died = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
        if died and not failure.startswith(f"rank {died[0]} exited"):
            # the crash is the cause: a peer's error (its connection closed) may arrive first
            failure = (f"rank {died[0]} exited with code {procs[died[0]].exitcode} without a "
                       f"result; before that was seen: {failure}")
        states = {r: ("returned" if r in results else
                      "running" if p.exitcode is None else f"exit code {p.exitcode}")
                  for r, p in enumerate(procs)}
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        # a rank killed by a signal (a crash in native code) shows its whole log: its
        # faulthandler stacks name the frame it died in, above the tail
        crashed = [r for r, p in enumerate(procs)
                   if states[r].startswith("exit code -")]
        shown = [CRASH_LINES if r in crashed else TAIL_LINES for r in range(world_size)]
        tails = "\n".join(f"--- rank {r} ({states[r]}), last lines ---\n"
                          f"{_tail(log_dir / f'rank{r}.log', shown[r])}"
                          for r in range(world_size))
        raise LaunchError(f"{fn.__name__} on {world_size} ranks: {failure}\n{tails}")
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    return [results[r] for r in range(world_size)]


def run_command(cmd: list[str], *, timeout: float, cwd: str | os.PathLike | None = None,
                env: dict[str, str] | None = None, tail: int = 60, check: bool = True) -> str:
    """Run a launcher command (``torchrun ...``) in its own process group with a deadline;
    return its stdout and stderr together. At the deadline (or, with ``check``, on a
    non-zero exit) the whole group (the launcher and every rank it started) is killed and
    :class:`LaunchError` shows the output's last ``tail`` lines."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        why = None if proc.returncode == 0 or not check else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        why = f"deadline of {timeout:.0f} s passed (every process of the launch killed)"
    if why is not None:
        last = "\n".join(f"  | {line}" for line in out.splitlines()[-tail:])
        raise LaunchError(f"{' '.join(cmd[:8])} ...: {why}; last lines:\n{last}")
    return out
