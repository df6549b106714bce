"""What a split backward holds from I to W: the planner's count against the lowered graphs'.

    .venv/bin/python benchmarks/split_backward_memory.py --model 70B --pp 8 --dp 8 --tp 8 \
        --schedule DualPipeV --microbatches 64 --batch-size 512 --seq-len 8192 \
        --mixed-precision bf16

Plans the layout exactly (``autopp.dry_run`` on a fake world, H100 profile) and prints, per
stage, the (F->I, I->W) microbatch counts at its peaks, the activations one microbatch
saves and what its W keeps from I, each as the planner's ILP counts it
(``StagePlan.activation_bytes`` / ``kept_for_w_bytes``) and as the lowered graphs hold it
(``StageFacts``, what the simulator runs); then each pp rank's simulated peak against the
usable memory. A layout with no plan that fits prints the planner's error (the consumers
it names). docs/design.md, `sharding/` ("what a split backward holds from I to W").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def layout_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The layout flags this script and ``collectives_ahead.py`` take (llama3, H100)."""
    p.add_argument("--model", default="70B")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--schedule", default="DualPipeV")
    p.add_argument("--microbatches", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--mixed-precision", choices=["bf16", "none"], default="bf16")
    return p


def planned(args: argparse.Namespace):
    """``autopp.dry_run`` of the layout ``args`` name (fake world, H100 profile)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import llama3_pp_dp_tp as example
    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mixed_precision == "bf16" else None)
    return dry_run(example.build_model(args.model), pp=args.pp, dp=args.dp, tp=args.tp,
                   schedule=args.schedule, n_microbatches=args.microbatches,
                   global_batch=args.batch_size, seq_len=args.seq_len,
                   options=PlannerOptions(mixed_precision=mp, profile="H100"))


def main() -> None:
    args = layout_arguments(argparse.ArgumentParser(
        description=__doc__.splitlines()[0])).parse_args()
    from autopp.sharding import InfeasiblePlanError

    t0 = time.perf_counter()
    try:
        report = planned(args)
    except InfeasiblePlanError as e:
        print(f"no plan fits ({time.perf_counter() - t0:.1f} s):\n{e}")
        return
    gib = float(2**30)
    print(f"planned and simulated in {time.perf_counter() - t0:.1f} s")
    print("stage  peaks (F->I/I->W)        recompute  activations plan/graphs GiB  "
          "kept for W plan/graphs GiB (ratio)")
    for s, st in enumerate(report.stages):
        plan, facts = st.plan, st.facts
        peaks = " ".join(f"{a:g}/{b:g}" for a, b in plan.split_in_flight) or "(whole B)"
        kept = facts.kept_for_w_bytes or 0
        ratio = f"{plan.kept_for_w_bytes / kept:.2f}" if kept else "-"
        print(f"{s:5d}  {peaks:24s} {plan.recompute:10s} "
              f"{plan.activation_bytes / gib:6.2f} / {(facts.activation_bytes or 0) / gib:6.2f}"
              f"            {plan.kept_for_w_bytes / gib:6.2f} / {kept / gib:6.2f} ({ratio})")
    over = [r for r, ok in enumerate(report.fits()) if not ok]
    print("simulated peak per pp rank: "
          + ", ".join(f"{b / gib:.1f}" for b in report.peak_bytes())
          + f" GiB (usable {report.usable_bytes / gib:.2f}; ranks over: {over})")


if __name__ == "__main__":
    main()
