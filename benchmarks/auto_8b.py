"""llama3-8B on a fake pp=4 × dp=8 × tp=8 mesh (256 ranks): dry run, planned vs torchtitan.

    .venv/bin/python benchmarks/auto_8b.py                 # 8B, 1F1B, 64 x 2048, 8 microbatches
    .venv/bin/python benchmarks/auto_8b.py --layers 8      # a shallower 8B (same blocks), faster
    .venv/bin/python benchmarks/auto_8b.py --bf16          # bf16 compute / fp32 reduction, both

Plans every pipeline stage of llama3-8B (torchtitan's config, SDPA) over its 8 × 8 sub-mesh with
the H100 profile, prices torchtitan's manual FSDP+TP layout of the same stages under the same
cost model (:func:`autopp.dry_run.dry_run` with ``compare=True``; each stage is planned under
the parameter memory torchtitan's layout uses for it) and prints, for both layouts, the
pipeline's step time simulated under the schedule (:mod:`autopp.schedules.simulate`, stage
costs from :mod:`autopp.estimate`), its bubble, and each pp rank's simulated peak memory by
category (parameters, gradients, AdamW state, gathered parameters, activations without
checkpointing) against the profile's memory minus 10%. Alpa's closed form is printed beside
the simulated step. It runs twice, each in a fresh process, on one temporary plan cache: the
first run solves every stage, the second reads them from the cache.

Batch: global 64 sequences of 2048 tokens in 8 microbatches, so one microbatch is a single
sequence per dp rank (torchtitan's llama3-8B default local batch is 1) and 8 dp-global rows
for the planner; 8 microbatches for 4 stages keep 1F1B's bubble at (pp−1)/M = 3/8. A larger
global batch with more microbatches only changes the pipeline formula, not the per-stage
problems.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(args) -> None:
    import dataclasses
    import logging

    import torch
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    cfg = build_decoder_config_for_backend(llama3_configs["8B"], "sdpa")
    if args.layers is not None:
        cfg.layers = cfg.layers[: args.layers]
    with torch.device("meta"):
        model = cfg.build()
    t0 = time.perf_counter()
    mp = None
    if args.bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    report = dry_run(model, pp=args.pp, dp=args.dp, tp=args.tp, schedule=args.schedule,
                     n_microbatches=args.microbatches, global_batch=args.global_batch,
                     seq_len=args.seq, compare=True,
                     options=PlannerOptions(profile=args.profile, mixed_precision=mp))
    wall = time.perf_counter() - t0
    print(report, flush=True)
    def peaks(which):
        return [{"peak": r.peak_bytes / 2**30,
                 **{k: v / 2**30 for k, v in dataclasses.asdict(r.memory_at_peak).items()}}
                for r in report.simulation_of(which).ranks]

    print("JSON" + json.dumps({
        "wall_s": wall,
        "step_ms": report.step_time_s * 1e3,
        "torchtitan_step_ms": report.torchtitan_step_time_s * 1e3,
        "bubble": report.bubble_fraction,
        "torchtitan_bubble": report.torchtitan_simulation.bubble_fraction,
        "alpa_ms": report.alpa_time_s() * 1e3,
        "torchtitan_alpa_ms": report.alpa_time_s("torchtitan") * 1e3,
        "boundaries": [s.boundary_out for s in report.stages],
        "ratio": report.step_time_ratio,
        "peaks": peaks("planned"),
        "torchtitan_peaks": peaks("torchtitan"),
        "usable_GiB": report.usable_bytes / 2**30,
        "mem_GiB": report.param_bytes_per_device() / 2**30,
        "torchtitan_mem_GiB": report.param_bytes_per_device("torchtitan") / 2**30,
        "p2p_MiB": report.p2p_bytes_per_step / 2**20,
        "stages": [{"modules": s.modules, "ms": s.time_s * 1e3,
                    "torchtitan_ms": s.torchtitan.step_time_s * 1e3,
                    "plan_s": s.plan_wall_s, "cached": s.cached,
                    "torchtitan_s": s.torchtitan_wall_s, "torchtitan_cached": s.torchtitan_cached}
                   for s in report.stages],
    }), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--profile", default="H100")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N of 8B's 32 layers (faster)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 compute, fp32 gradient reduction (torchtitan's default policy) "
                         "for both layouts")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one_run(args)
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="autopp-plans-") as cache:
        env = dict(os.environ, AUTOPP_PLAN_CACHE=cache)
        for name in ("first (solve)", "second (cached)"):
            proc = subprocess.run([sys.executable, __file__, "--one", *sys.argv[1:]], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, text=True, check=True)
            lines = proc.stdout.splitlines()
            if not runs:
                print("\n".join(ln for ln in lines if not ln.startswith("JSON")))
            runs.append(json.loads(next(ln for ln in lines if ln.startswith("JSON"))[4:]))
            print(f"{name} run: {runs[-1]['wall_s']:.1f} s", flush=True)
    first, second = runs
    print("\nSummary")
    print(f"  simulated step time ({args.schedule}): planned {first['step_ms']:.1f} ms (bubble "
          f"{first['bubble']:.1%}), torchtitan FSDP+TP {first['torchtitan_step_ms']:.1f} ms "
          f"(bubble {first['torchtitan_bubble']:.1%}): planned/torchtitan {first['ratio']:.3f}")
    alpa, tt_alpa = first["alpa_ms"], first["torchtitan_alpa_ms"]
    print(f"  closed form (Alpa): planned {alpa:.1f} ms, torchtitan {tt_alpa:.1f} ms: "
          f"{alpa / tt_alpa:.3f}")
    print(f"  simulated peak memory per device by pp rank, GiB (usable {first['usable_GiB']:.2f}):")
    cats = ("parameters", "gradients", "optimizer", "gathered_parameters", "activations")
    print("    layout      rank " + "".join(f"{c[:10]:>11}" for c in cats) + "       peak")
    for name, key in (("planned", "peaks"), ("torchtitan", "torchtitan_peaks")):
        for r, m in enumerate(first[key]):
            print(f"    {name:<11} {r:>4} " + "".join(f"{m[c]:>11.2f}" for c in cats)
                  + f"{m['peak']:>11.2f}")
    print(f"  chosen boundaries (last: logits): {first['boundaries']}")
    print(f"  parameter memory per device: planned {first['mem_GiB']:.2f} GiB, torchtitan "
          f"{first['torchtitan_mem_GiB']:.2f} GiB; p2p per step per device "
          f"{first['p2p_MiB']:.1f} MiB")
    print("  planning time per stage (planned + torchtitan reference), first / second run:")
    for i, (a, b) in enumerate(zip(first["stages"], second["stages"])):
        print(f"    stage {i} ({a['modules']}): {a['plan_s']:.1f} + {a['torchtitan_s']:.1f} s "
              f"({'cached' if a['cached'] else 'solved'}) / {b['plan_s']:.2f} + "
              f"{b['torchtitan_s']:.2f} s ({'cached' if b['cached'] else 'solved'}); "
              f"{a['ms']:.2f} vs {a['torchtitan_ms']:.2f} ms per microbatch")


if __name__ == "__main__":
    main()
