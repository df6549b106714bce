"""``autopp.search`` on a torchtitan mixture-of-experts model, then the exact plan of its best
layout: the ranking (expert layout and token dispatch per candidate), the wall times, and
whether the exact plan fits.

    .venv/bin/python benchmarks/moe_search.py --model 671B --world 512 --batch-size 256 \\
        --seq-len 4096

``--model``: as in ``moe_dry_run.py`` (a deepseek_v3 flavour or ``qwen3_moe``). Mixed
precision is bf16 parameters with fp32 gradient reductions; the plan cache is whatever
``AUTOPP_PLAN_CACHE`` names (give an empty folder for a cold run).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="671B")
    ap.add_argument("--world", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--profile", default="H100")
    ap.add_argument("--expert-imbalance", type=float, default=1.0)
    ap.add_argument("--dispatch", default="auto", choices=("auto", "all_to_all", "all_gather"))
    ap.add_argument("--expert-dims", default="auto", choices=("auto", "dp", "tp", "dp*tp"),
                    help="the stage-mesh dims the routed experts are split over "
                    "(PlannerOptions.expert_dims; auto: the planner chooses)")
    ap.add_argument("--no-plan", action="store_true", help="rank only, no exact plan")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(message)s")
    for noisy in ("torch", "torchtitan", "autopp.sharding", "autopp.plan.local_stage"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from moe_dry_run import build
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import autopp
    from autopp.layout_search.exact import plan_ranked

    model = build(args.model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = autopp.PlannerOptions(profile=args.profile, mixed_precision=mp,
                                    token_dispatch=args.dispatch,
                                    expert_dims=args.expert_dims,
                                    expert_imbalance=args.expert_imbalance)
    t0 = time.perf_counter()
    report = autopp.search(model, world_size=args.world, global_batch=args.batch_size,
                           seq_len=args.seq_len, options=options)
    searched = time.perf_counter() - t0
    print(report, flush=True)
    print(f"search wall time {searched:.1f} s")
    if args.no_plan:
        return
    exact = plan_ranked(report)
    total = time.perf_counter() - t0
    for line in exact.skipped:
        print(f"skipped: {line}")
    if exact.report is not None:
        print(exact.report)
        peaks = ", ".join(f"{p / 2**30:.1f}" for p in exact.report.peak_bytes())
        print(f"exact plan of layout {exact.rank + 1} ({report.results[exact.rank].layout}): "
              f"step {exact.report.step_time_s * 1e3:.1f} ms, peaks {peaks} GiB of "
              f"{exact.report.usable_bytes / 2**30:.1f}, "
              f"{'fits' if not exact.over else f'over on pp ranks {list(exact.over)}'}")
    print(f"search + exact plan wall time {total:.1f} s (search {searched:.1f} s)")


if __name__ == "__main__":
    main()
    from autopp.cli import skip_exit_collection

    skip_exit_collection()  # as the autopp command does: no collection of planning's heap at exit
