"""Workers for tests/compat/test_gloo_race.py (run under tests.harness.launch), and the driver the tests
start as a process of its own so that the window-widening preload (scripts/gloo_race/) is
loaded into every rank:

    LD_PRELOAD=/tmp/widen_race.so python -m tests.harness.workers.gloo_race SECONDS

runs a planned llama3 pp2 x dp2 pipeline (1F1B, 4 microbatches: gathers and reductions of one
dp group in flight together) on 4 gloo ranks for SECONDS of AdamW steps (10 at least). It prints ``clean``
with the steps run, or ``crash`` with the harness's error, and exits 0 or 1.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from tests.harness.case import Case

#: The pipeline the driver runs: the planner's default options (overlap on), so collectives
#: of one group are in flight together, as in the crashes the race caused.
CASE = Case(pp=2, dp=2, n_microbatches=4, parallelize="auto")


#: Steps the driver runs at least, however long they take (a loaded machine): the race
#: showed within the first steps when measured.
MIN_STEPS = 10


def train_for(rank: int, world_size: int, seconds: float) -> dict:
    """AdamW steps of :data:`CASE` until ``seconds`` have passed and :data:`MIN_STEPS` are
    done (rank 0 decides, so every rank runs the same steps); the steps, the first losses
    and the gloo worker threads of every group of the mesh."""
    from autopp._compat.gloo import worker_threads
    from tests.harness.workers.pipeline import _build

    t0 = time.monotonic()
    pipe, batch = _build(CASE, CASE, seed=0)
    print(f"[race] built in {time.monotonic() - t0:.0f} s", flush=True)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    tok, tgt = batch(0)
    losses, go, t0 = [], torch.ones(1), time.monotonic()
    while go.item():
        losses.append(float(pipe.step(tok, target=tgt)))
        opt.step()
        pipe.zero_grad()
        print(f"[race] step {len(losses)}", flush=True)
        go.fill_(float(time.monotonic() - t0 < seconds or len(losses) < MIN_STEPS))
        dist.broadcast(go, src=0)
    groups = [pipe.mesh.get_group(d) for d in range(pipe.mesh.ndim)]
    return dict(steps=len(losses), losses=losses[:3], world_threads=worker_threads(),
                mesh_threads=[worker_threads(g) for g in groups])


def abort_like_glibc(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 dies as glibc's heap check kills a process (its message, then SIGABRT) and
    appends a line to ``marker`` for each launch, so a test sees whether it was launched
    again; rank 0 waits to be killed."""
    import os

    if rank == 1:
        with open(marker, "a") as f:
            f.write("launched\n")
        print("malloc(): unaligned tcache chunk detected", file=sys.stderr, flush=True)
        os.abort()
    time.sleep(30)
    return rank


def main() -> int:
    from tests.harness.launch import LaunchError, run_on_ranks

    seconds = float(sys.argv[1])
    t0 = time.monotonic()
    try:
        # a hang (the race can corrupt gloo's state instead of the allocator's) ends at the
        # work deadline, which leaves room for planning on a loaded machine
        out = run_on_ranks(train_for, 4, seconds, timeout=seconds + 900,
                           work_timeout=seconds + 480)
    except LaunchError as e:
        print(f"crash after {time.monotonic() - t0:.0f} s\n{e}", flush=True)
        return 1
    print(f"clean: {out[0]['steps']} steps in {time.monotonic() - t0:.0f} s; "
          f"losses {out[0]['losses']}; gloo worker threads: world {out[0]['world_threads']}, "
          f"mesh {out[0]['mesh_threads']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
