"""What the layout search's probes cost, sub-mesh by sub-mesh, in one process.

    .venv/bin/python benchmarks/probe_time.py                      # 70B / 512, fp32, all sub-meshes
    .venv/bin/python benchmarks/probe_time.py --submeshes 2x8,64x8  # some (dp x tp)
    .venv/bin/python benchmarks/probe_time.py --presolve-all        # time-only MIPs presolved too

For each (dp, tp) sub-mesh of the search's layouts (at the reference microbatch count the
search uses), both of the search's rounds, as it probes them: "none", then selective / full /
none@lean / full@lean. Printed per round: wall seconds, HiGHS seconds, and the MIPs among
the HiGHS runs (count and seconds): a time-only solve whose LP relaxation is fractional.
``--presolve-all`` runs those MIPs with HiGHS's presolve, as before 2026-12-05 (the planner
turns it off for them). Set ``AUTOPP_PLAN_CACHE`` to an empty directory: cached probe plans
are not solved again.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="70B")
    ap.add_argument("--world", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--mixed-precision", default="none", choices=["none", "bf16"])
    ap.add_argument("--submeshes", default=None, help="dp x tp list, e.g. 2x8,64x8")
    ap.add_argument("--presolve-all", action="store_true")
    args = ap.parse_args()

    import torch
    import llama3_pp_dp_tp as ex

    import autopp.sharding.ilp.highs as highs
    from autopp.layout_search.layouts import DEFAULT_SCHEDULES, enumerate_layouts
    from autopp.layout_search.probe_pool import JOB, probe_job
    from autopp.profiles.lookup import get_profile
    from autopp.stage_split import inspect_model

    runs: list[tuple[bool, float]] = []  # (MIP, seconds) of each HiGHS run
    solve = highs.WarmLps.run

    def run(self, lp, upper, integer, as_mip, *a, **kw):
        if args.presolve_all:
            kw["presolve"] = True
        out = solve(self, lp, upper, integer, as_mip, *a, **kw)
        runs.append((as_mip, out[1]))
        return out

    highs.WarmLps.run = run
    mp = None
    if args.mixed_precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = ex.build_model(args.model)
    info = inspect_model(model, None)
    prof = get_profile("H100")
    JOB.update(model=model, layout=info, world=args.world, global_batch=args.batch_size,
               seq_len=args.seq_len, profile=prof.name, mp=mp, tf32=False)
    layouts, _ = enumerate_layouts(
        world_size=args.world, global_batch=args.batch_size, n_layers=info.n_layers,
        devices_per_node=prof.devices_per_node, schedules=DEFAULT_SCHEDULES, tp_sizes=None,
        pp_sizes=None, microbatch_choices=3, stages_per_rank=(2, 3, 4),
        end_stages=int(bool(info.pre)) + int(bool(info.post)))
    families: dict[tuple[int, int], list] = collections.defaultdict(list)
    for lay in layouts:
        families[lay.dp, lay.tp].append(lay)
    keys = sorted(families)
    if args.submeshes:
        keys = [tuple(int(v) for v in s.split("x")) for s in args.submeshes.split(",")]
    rounds = (("none",), ("selective", "full", "none@lean", "full@lean"))
    total = collections.Counter()
    for dp, tp in keys:
        fam = families[dp, tp]
        m_ref = sorted(lay.n_microbatches for lay in fam)[len(fam) // 2]  # as the search
        cells = []
        for r, modes in enumerate(rounds):
            runs.clear()
            t0 = time.perf_counter()
            got = probe_job(dp, tp, fam[0].pp, m_ref, modes)
            wall = time.perf_counter() - t0
            mips = [s for mip, s in runs if mip]
            total["wall", r] += wall
            total["mip", r] += sum(mips)
            cells.append(f"{wall:5.1f} s, HiGHS {sum(s for _, s in runs):5.1f} s, "
                         f"{len(mips)} MIPs {sum(mips):5.1f} s"
                         + ("" if not isinstance(got, str) else f" ({got[:60]})"))
        print(f"dp={dp:<3} tp={tp} pp={fam[0].pp:<2} m={m_ref:<3} | " + " | ".join(cells),
              flush=True)
    how = "presolved" if args.presolve_all else "as the planner runs them"
    print(f"{len(keys)} sub-meshes, time-only MIPs {how}: round one {total['wall', 0]:.1f} s (MIPs {total['mip', 0]:.1f} s), "
          f"round two {total['wall', 1]:.1f} s (MIPs {total['mip', 1]:.1f} s), all "
          f"{total['wall', 0] + total['wall', 1]:.1f} s (MIPs "
          f"{total['mip', 0] + total['mip', 1]:.1f} s)")


if __name__ == "__main__":
    main()
