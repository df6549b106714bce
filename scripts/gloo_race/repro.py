"""Standalone reproduction of the data race in torch's ProcessGroupGloo (no autopp needed).

Two gloo ranks keep eight functional collectives of one group in flight, all_gather (named
ALLGATHER_COALESCED on gloo: a heap-allocated std::string) alternating with all_reduce, so
the group's two worker threads finish collectives at the same moment and both assign
pgStatus_->lastCompletedWorkName without a lock. Under widen_race.so the race is near
certain within a minute; without it, rare (a loaded machine, many iterations).

    cc -O2 -shared -fPIC -o /tmp/widen_race.so scripts/gloo_race/widen_race.c -ldl
    LD_PRELOAD=/tmp/widen_race.so python scripts/gloo_race/repro.py [SECONDS] [THREADS]

THREADS: gloo worker threads per group (torch's default 2; 1 avoids the race). Prints
``clean: N iterations in S s`` and exits 0, or reports the rank that died (or the ranks
that hung: the corruption can also leave a worker spinning) and exits 1.
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, path: str, seconds: float, threads: int) -> None:
    torch.set_num_threads(1)
    if threads != 2:  # the group every collective below uses is this one
        orig = dist.distributed_c10d.ProcessGroupGloo

        class Gloo(orig):
            def __init__(self, store, rank, size, timeout, **kw):
                opts = orig._Options()
                opts._devices = [orig.create_default_device()]
                opts._threads, opts._timeout = threads, timeout
                for k, v in kw.items():  # torch 2.14: enable_reconfigure
                    setattr(opts, k, v)
                super().__init__(store, rank, size, opts)

        dist.distributed_c10d.ProcessGroupGloo = Gloo
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    fc, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
    end, it, stop = time.monotonic() + seconds, 0, torch.zeros(1)
    while True:
        pending = []
        for k in range(8):
            x = torch.full((1 + k % 3,), float(k))
            pending.append(fc.all_gather_into_tensor.default(x, world, name) if k % 2 == 0
                           else fc.all_reduce.default(x, "sum", name))
            del x  # as FX graph code drops an input once issued
        for p in pending:
            fc.wait_tensor.default(p)
        it += 1
        if it % 200 == 0:  # agree on stopping
            stop.fill_(float(time.monotonic() > end))
            dist.all_reduce(stop)
            if stop.item():
                break
    if rank == 0:
        print(f"clean: {it} iterations in {seconds:.0f} s", flush=True)
    dist.destroy_process_group()


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    path = os.path.join(tempfile.mkdtemp(), "rendezvous")
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, 2, path, seconds, threads)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = t0 + seconds + 120  # start-up and the last iterations, with room
    while (any(p.exitcode is None for p in procs) and time.monotonic() < deadline
           and not any(p.exitcode for p in procs)):
        time.sleep(0.2)
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    for p in procs:
        p.join(5)
    hung = [r for r, p in enumerate(procs) if p.is_alive()] if not dead else []
    for p in procs:
        if p.is_alive():
            p.kill()
    took = time.monotonic() - t0
    what = (f"rank {dead[0][0]} died (exit code {dead[0][1]})" if dead else
            f"ranks {hung} hung (a worker spinning on corrupted state)" if hung else "no crash")
    print(f"torch {torch.__version__}, {threads} gloo worker thread(s): {what} "
          f"after {took:.0f} s", flush=True)
    return 1 if dead or hung else 0


if __name__ == "__main__":
    sys.exit(main())
