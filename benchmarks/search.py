"""``autopp.search`` against torchtitan's hand layouts, under the same simulator, and its time.

Searches llama3 (torchtitan's preset, bf16 compute / fp32 gradients) for a number of H100s
and compares the best layout's simulated step with the best-microbatch pricing of the hand
layouts torchtitan documents for that scale (FSDP, FSDP+TP, FSDP+TP+PP with 1F1B and
Interleaved1F1B), every one priced by the same search (probe plans of autopp's planner, the
cost-balanced split, the schedule simulator): the ratio is a layout choice's effect, the
placements inside each sub-mesh being autopp's in both. Search time is measured cold (an
empty plan cache) in fresh processes: the median of ``--repeats``.

    .venv/bin/python benchmarks/search.py --model 8B --world 64 --batch-size 64 --seq-len 8192
    .venv/bin/python benchmarks/search.py --model 70B --world 512 --batch-size 512 --seq-len 8192
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

# torchtitan's documented layouts (its llama3 H100 benchmarks and configs): FSDP over all
# devices, FSDP x TP8 (2D), and FSDP x TP8 x PP with 1F1B / Interleaved1F1B (3D)
HAND = {
    "FSDP": dict(tp=1, pp=1, schedules=("1F1B",)),
    "FSDP+TP": dict(tp=8, pp=1, schedules=("1F1B",)),
    "FSDP+TP+PP4 1F1B": dict(tp=8, pp=4, schedules=("1F1B",)),
    "FSDP+TP+PP4 Interleaved1F1B": dict(tp=8, pp=4, schedules=("Interleaved1F1B",)),
    "FSDP+TP+PP8 Interleaved1F1B": dict(tp=8, pp=8, schedules=("Interleaved1F1B",)),
}


def _search(args) -> dict:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import autopp
    from llama3_pp_dp_tp import build_model

    import resource

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    report = autopp.search(build_model(args.model), world_size=args.world,
                           global_batch=args.batch_size, seq_len=args.seq_len,
                           options=autopp.PlannerOptions(profile="H100", mixed_precision=mp))
    print(report, flush=True)
    # CPU seconds of this process and its probe workers: steadier than the wall time on a
    # shared machine (taken before the hand layouts below are priced)
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,
              resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    out = {"search_s": report.search_s, "cpu_s": cpu, "best": str(report.best.layout),
           "best_step_s": report.best.step_time_s, "hand": {}}
    for name, h in HAND.items():
        # the search leaves dominated layouts out unsimulated: price each hand layout by a
        # search restricted to it (untimed; the probes come from the plan cache)
        if h["pp"] * h["tp"] > args.world or args.world % (h["pp"] * h["tp"]):
            out["hand"][name] = (None, "not a layout of this world")
            continue
        try:
            mine = autopp.search(build_model(args.model), world_size=args.world,
                                 global_batch=args.batch_size, seq_len=args.seq_len,
                                 options=autopp.PlannerOptions(profile="H100",
                                                               mixed_precision=mp),
                                 tp_sizes=(h["tp"],),
                                 pp_sizes=(h["pp"],), schedules=h["schedules"],
                                 max_results=None)
        except ValueError as e:  # no layout at all
            out["hand"][name] = (None, str(e).split(":")[0])
            continue
        if mine.results:
            c = mine.results[0]
            out["hand"][name] = (str(c.layout), c.step_time_s)
        else:
            out["hand"][name] = (None, mine.rejected[0][1] if mine.rejected else "no layout")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="8B")
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=1, help="fresh cold processes to time")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_search(args)), flush=True)
        return
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, AUTOPP_PLAN_CACHE=cache)
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--world",
                   str(args.world), "--batch-size", str(args.batch_size), "--seq-len",
                   str(args.seq_len)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
            runs.append(json.loads(line[len("RESULT "):]))
            if len(runs) == 1:
                print(out.stdout.split("RESULT ")[0])
    r = runs[0]
    times = [x["search_s"] for x in runs]
    cpus = [x["cpu_s"] for x in runs]
    print(f"llama3-{args.model} on {args.world} H100s, global batch {args.batch_size} x seq "
          f"{args.seq_len}: search {statistics.median(times):.1f} s (median of {len(times)} "
          f"cold runs: {', '.join(f'{t:.1f}' for t in times)}); CPU "
          f"{statistics.median(cpus):.1f} s ({', '.join(f'{t:.1f}' for t in cpus)})")
    print(f"best: {r['best']}  {r['best_step_s'] * 1e3:.1f} ms")
    print(f"{'torchtitan layout':30} {'as priced (best microbatches)':44} {'step ms':>9} "
          f"{'hand / best':>11}")
    for name, (lay, v) in r["hand"].items():
        if lay is None:
            print(f"{name:30} {'-':44} {'-':>9} {'-':>11}  ({v})")
        else:
            print(f"{name:30} {lay:44} {v * 1e3:>9.1f} {v / r['best_step_s']:>11.3f}")


if __name__ == "__main__":
    main()
