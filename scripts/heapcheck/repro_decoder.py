"""Loop the first config of tests/models/test_any_decoder.py (torchtitan qwen3, tied embeddings, pp2 x
dp2 x tp2, 1F1B, 2 microbatches, the planner, fp32) on 8 gloo processes: each iteration plans
in a fresh plan cache (as the test's first step does), builds the pipeline and runs ``steps``
AdamW steps. Meant to run under scripts/heapcheck/run.sh, or plain to count crashes:

    PYTHONPATH=. python scripts/heapcheck/repro_decoder.py ITERATIONS STEPS ['{"model": "qwen3"}']

Options (JSON): model (a tests.harness.models key), pp/dp/tp, schedule, nmb (microbatches), fresh
(plan again every iteration; default true), plans (a plan cache directory to use instead,
e.g. a test session's: its plans, not new ones; the planner breaks ties between equal-cost
placements differently from one process to the next), parallelize ("auto" or null), overlap (the planner's
``overlap_collectives``), dump (a directory: every rank writes its stages' lowered graphs there
on the first iteration). Prints OK, or FAIL with the harness's error (the ranks' log tails).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from tests.harness.launch import run_on_ranks
from tests.harness.models import MODELS, ce_loss, make_batch


def worker(rank: int, world_size: int, iterations: int, steps: int, root: str, kw: dict):
    from autopp import build_world_mesh, pipeline_autoparallel
    from autopp.backends import Planner, PlannerOptions

    tokens, target = make_batch(8, 16)
    for it in range(iterations):
        os.environ["AUTOPP_PLAN_CACHE"] = kw.get("plans") or (
            f"{root}/plans{it if kw.get('fresh', True) else ''}")
        mesh = build_world_mesh(pp=kw.get("pp", 2), dp=kw.get("dp", 2), tp=kw.get("tp", 2))
        dp_rank, dp = mesh.get_coordinate()[1], mesh.shape[1]
        n = 8 // dp
        tok, tgt = tokens[dp_rank * n:(dp_rank + 1) * n], target[dp_rank * n:(dp_rank + 1) * n]
        parallelize = kw.get("parallelize", "auto")
        if parallelize == "auto" and "overlap" in kw:
            parallelize = Planner(PlannerOptions(overlap_collectives=bool(kw["overlap"])))
        t0 = time.time()
        pipe = pipeline_autoparallel(
            MODELS[kw.get("model", "qwen3")](4), mesh, example_inputs=(tok,), loss_fn=ce_loss,
            schedule=kw.get("schedule", "1F1B"), n_microbatches=kw.get("nmb", 2),
            parallelize=parallelize)
        pipe.init_weights(seed=0)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        t1 = time.time()
        for _ in range(steps):
            pipe.step(tok, target=tgt)
            opt.step()
            opt.zero_grad()
        if kw.get("dump") and it == 0:
            from pathlib import Path

            d = Path(kw["dump"]) / f"rank{rank}"
            d.mkdir(parents=True, exist_ok=True)
            for stage in pipe._stages:
                for name, gm in getattr(stage, "graphs").graphs().items():
                    (d / f"stage{stage.stage_index}_{name}.py").write_text(gm.code)
        print(f"[repro] iteration {it}: build {t1 - t0:.1f} s, {steps} steps "
              f"{time.time() - t1:.1f} s", flush=True)
        dist.barrier()


def main() -> None:
    iterations, steps = int(sys.argv[1]), int(sys.argv[2])
    kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    world = kw.get("pp", 2) * kw.get("dp", 2) * kw.get("tp", 2)
    root = tempfile.mkdtemp(prefix="autopp-heap-plans-")
    t = time.time()
    try:
        run_on_ranks(worker, world, iterations, steps, root, kw, timeout=3600)
        print(f"OK {time.time() - t:.0f} s")
    except Exception as e:  # the harness's LaunchError: each rank's last lines
        print(f"FAIL {time.time() - t:.0f} s")
        print(str(e)[-8000:])


if __name__ == "__main__":
    main()
