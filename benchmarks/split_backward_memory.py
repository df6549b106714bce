"""What a split backward holds from I to W, and what the planner's count leaves out.

    .venv/bin/python benchmarks/split_backward_memory.py --model 70B --pp 8 --dp 16 --tp 4 \
        --schedule ZBVZeroBubble --microbatches 32 --batch-size 512 --seq-len 8192 \
        --mixed-precision bf16

Plans the layout exactly (``autopp.dry_run`` on a fake world, H100 profile) and prints each
pp rank's simulated peak twice: as the dry run simulates it (each stage keeps its W graph's
inputs from the end of I to the end of W: ``StageCost.activation_bytes_kept_for_w``, from
the lowered graphs), and with those bytes set to the stage's saved activations, which is
what the planner's memory row counts (docs/design.md, "Known gap: what a split backward
holds from I to W"). The second simulation reuses the first's plan (the plan cache). A
schedule that does not split the backward prints the same peaks twice.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="70B")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--dp", type=int, default=16)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--schedule", default="ZBVZeroBubble")
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--mixed-precision", choices=["bf16", "none"], default="bf16")
    args = p.parse_args()

    from torch.distributed.fsdp import MixedPrecisionPolicy

    import llama3_pp_dp_tp as example
    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    simulate = importlib.import_module("autopp.schedules.simulate")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mixed_precision == "bf16" else None)
    kw = dict(pp=args.pp, dp=args.dp, tp=args.tp, schedule=args.schedule,
              n_microbatches=args.microbatches, global_batch=args.batch_size,
              seq_len=args.seq_len,
              options=PlannerOptions(mixed_precision=mp, profile="H100"))

    def peaks(report) -> str:
        gib = ", ".join(f"{b / 2**30:.1f}" for b in report.peak_bytes())
        over = [r for r, ok in enumerate(report.fits()) if not ok]
        return f"{gib} GiB (usable {report.usable_bytes / 2**30:.2f}; ranks over: {over})"

    print("as simulated (kept from I to W: the W graphs' inputs):",
          peaks(dry_run(example.build_model(args.model), **kw)))
    kept = simulate.StageCost.kept_for_w_bytes
    simulate.StageCost.kept_for_w_bytes = property(
        lambda self: self.activation_bytes_per_microbatch)
    try:
        print("kept from I to W = the saved activations (the planner's count):",
              peaks(dry_run(example.build_model(args.model), **kw)))
    finally:
        simulate.StageCost.kept_for_w_bytes = kept


if __name__ == "__main__":
    main()
