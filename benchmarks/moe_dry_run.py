"""Dry run of a torchtitan mixture-of-experts model on many ranks (fake process group):
the plan, each pp rank's memory, the simulated step and the planning time.

    .venv/bin/python benchmarks/moe_dry_run.py --model 671B --pp 16 --dp 4 --tp 8 \\
        --batch-size 256 --seq-len 4096 --microbatches 32 --schedule Interleaved1F1B

``--expert-imbalance 1.25`` prices the busiest expert-parallel device at 1.25 times the mean
share of routed tokens (default: uniform routing). ``--dispatch all_to_all`` plans expert parallelism as torchtitan's EP (tokens sent to their
experts' devices by all-to-all); the default lets the planner choose.
``--model`` is a deepseek_v3 registry name (debugmodel, 16B, 236B, 671B) or ``qwen3_moe``
(qwen3's debugmodel_moe). Attention is SDPA (torchtitan's flex attention does not trace on
meta); mixed precision is bf16 parameters with fp32 gradient reductions, as torchtitan trains.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch


def build(name: str) -> torch.nn.Module:
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )

    if name == "qwen3_moe":
        from torchtitan.models.qwen3 import qwen3_configs

        cfg = build_decoder_config_for_backend(qwen3_configs["debugmodel_moe"], "sdpa")
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs

        cfg = build_decoder_config_for_backend(deepseekv3_configs[name], "sdpa",
                                               moe_comm_backend="standard")
    with torch.device("meta"):
        return cfg.build()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="671B")
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--schedule", default="Interleaved1F1B")
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--profile", default="H100")
    ap.add_argument("--fp32", action="store_true", help="no mixed precision")
    ap.add_argument("--dispatch", default="auto", choices=("auto", "all_to_all", "all_gather"),
                    help="how tokens may reach expert-parallel devices "
                    "(PlannerOptions.token_dispatch)")
    ap.add_argument("--expert-dims", default="auto", choices=("auto", "dp", "tp", "dp*tp"),
                    help="the stage-mesh dims the routed experts are split over "
                    "(PlannerOptions.expert_dims; auto: the planner chooses)")
    ap.add_argument("--expert-imbalance", type=float, default=1.0,
                    help="the busiest expert-parallel device's routed tokens over the mean "
                    "(PlannerOptions.expert_imbalance; 1: uniform routing)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(message)s")
    for noisy in ("torch", "torchtitan"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    model = build(args.model)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n / 1e9:.1f}B parameters, {len(model.layers)} layers")
    mp = None if args.fp32 else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)
    t0 = time.perf_counter()
    report = dry_run(model, pp=args.pp, dp=args.dp, tp=args.tp, schedule=args.schedule,
                     n_microbatches=args.microbatches, global_batch=args.batch_size,
                     seq_len=args.seq_len,
                     options=PlannerOptions(profile=args.profile, mixed_precision=mp,
                                            token_dispatch=args.dispatch,
                                            expert_dims=args.expert_dims,
                                            expert_imbalance=args.expert_imbalance))
    print(report)
    print(f"dry run wall time {time.perf_counter() - t0:.1f} s")
    print("routed experts (forward, backward) as planned, over the (dp, tp) sub-mesh:")
    for layout, count in sorted(expert_layouts(report).items()):
        print(f"  {count:3d} x {layout}")


def expert_layouts(report) -> dict[str, int]:
    """How many routed-experts nodes each way: where the experts are split and how tokens
    reach them (all-to-all over the dims tokens and experts share, else all-gather)."""
    out: dict[str, int] = {}
    for stage in report.stages:
        for block in stage.plan.blocks:
            for name, _, ins in block.nodes:
                if not name.startswith("routed_experts"):
                    continue
                bwd = "backward" in name
                x, eids = ins[1 if bwd else 0], ins[4 if bwd else 3]
                ep = [d for d, e in zip(("dp", "tp"), eids) if e.startswith("S")]
                a2a = [d for d, e, t in zip(("dp", "tp"), eids, x)
                       if e.startswith("S") and t.startswith("S")]
                how = (f"all-to-all over {'x'.join(a2a)}" if a2a
                       else "all-gather" if ep else "experts not split")
                key = (f"{'backward' if bwd else 'forward '}: experts over "
                       f"{'x'.join(ep) or '-'}, tokens {'/'.join(x)}: {how}")
                out[key] = out.get(key, 0) + 1
    return out


if __name__ == "__main__":
    main()
    from autopp.cli import skip_exit_collection

    skip_exit_collection()  # as the autopp command does: no collection of planning's heap at exit
