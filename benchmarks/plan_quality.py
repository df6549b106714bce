"""How far the planner's stage plans are from the best plan an exact ILP could give.

    .venv/bin/python benchmarks/plan_quality.py stages    # composed vs the whole-stage MIP
    .venv/bin/python benchmarks/plan_quality.py layouts   # four pipelines: gaps and steps

The planner composes a stage from its units (the part before the blocks, each block, the
part after: :mod:`autopp.sharding.chain.budget`), each solved on its own under a memory price,
chained over boundary placements and mixed under the stage's budget. Two checks of what
that costs against exact methods:

``stages``: a small stage (2 llama3 debugmodel blocks on dp=2 x tp=2, AdamW state, 2
microbatches in flight, gradients reduced once a step over 8 microbatches) under budgets
that bind (80% to 40% of the fastest plan's memory). Each is planned as the planner plans
it, and as one flat ILP of the whole stage with the budget in its row, solved by HiGHS to
a 1e-7 gap (``reuse_blocks=False``, the search forced to polish): the exact per-stage ILP
plan, minutes a stage at this size, out of reach at 8B and above. Prints both times and
their ratio.

``layouts``: four pipelines (8B and 70B; 1F1B and a V schedule; budgets binding or not)
planned as the dry run plans them: each stage's time against its certified lower bound
(a bound on every plan of the stage's units under its budget, the exact stage ILP's
included: ``StagePlan.time_bound_s``), the simulated step, and whether every rank fits.
Run it on two checkouts (``PYTHONPATH=<checkout>``) to compare plans side by side.

Each case runs in a fresh process with empty plan and profile caches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

FRACTIONS = (0.8, 0.6, 0.5, 0.4)

# (name, model, pp, dp, tp, schedule, microbatches, batch, seq, bf16, memory reserve)
LAYOUTS = (
    ("8B 1F1B, budget free", "8B", 4, 2, 2, "1F1B", 8, 16, 2048, False, 0.1),
    ("8B ZBVZeroBubble, budget binding", "8B", 4, 2, 2, "ZBVZeroBubble", 8, 16, 2048, False,
     0.7),
    ("70B 1F1B, budget binding", "70B", 4, 8, 8, "1F1B", 16, 256, 8192, True, 0.1),
    ("70B DualPipeV, budget binding", "70B", 8, 8, 8, "DualPipeV", 64, 512, 8192, True, 0.1),
)


def _stage_case(frac: float) -> dict:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from autopp.mesh import init_fake_world
    from autopp.sharding.chain import budget as B
    from autopp.sharding import StageMemory, StageRequest, plan_stage
    from plan_time import build_stage

    init_fake_world(4)
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.empty(4, 64, 256, device="meta")
    stage = build_stage(2, "debugmodel")
    ask = StageRequest(module=stage, example_inputs=(x,), mesh=mesh,
                       memory=StageMemory(activation_factor=2.0, optimizer_state_factor=2.0,
                                          recompute="none"), microbatches_per_grad_reduce=8)
    budget = frac * plan_stage(ask).memory_bytes
    t0 = time.perf_counter()
    composed = plan_stage(ask.replace(budget_bytes=budget))
    composed_s = time.perf_counter() - t0
    # the exact whole-stage ILP: one flat model, the budget in its row, polished to 1e-7
    B.CERTIFIED_GAP, B._POLISH_GAP, B.POLISH_TARGET = -1.0, 1e-7, False
    B.POLISH_NODES, B.POLISH_TIME_S = 10**7, 1800.0
    t0 = time.perf_counter()
    exact = plan_stage(ask.replace(budget_bytes=budget, reuse_blocks=False,
                                   time_limit_s=1800.0))
    exact_s = time.perf_counter() - t0
    return {"fraction": frac, "budget": budget,
            "composed_s": composed.step_time_s, "composed_bytes": composed.memory_bytes,
            "composed_bound_s": composed.time_bound_s, "composed_wall_s": composed_s,
            "exact_s": exact.step_time_s, "exact_bytes": exact.memory_bytes,
            "exact_wall_s": exact_s}


def _layout_case(i: int) -> dict:
    import torch
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    name, model, pp, dp, tp, schedule, m, batch, seq, bf16, reserve = LAYOUTS[i]
    cfg = build_decoder_config_for_backend(llama3_configs[model], "sdpa")
    with torch.device("meta"):
        meta = cfg.build()
    mp = None
    if bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    t0 = time.perf_counter()
    report = dry_run(meta, pp=pp, dp=dp, tp=tp, schedule=schedule, n_microbatches=m,
                     global_batch=batch, seq_len=seq,
                     options=PlannerOptions(profile="H100", mixed_precision=mp,
                                            memory_reserve=reserve))
    wall = time.perf_counter() - t0
    stages = [{"time_s": s.plan.step_time_s, "bound_s": s.plan.time_bound_s,
               "recompute": s.plan.recompute} for s in report.stages]
    return {"name": name, "step_s": report.simulation.step_time_s,
            "fits": all(report.fits()), "wall_s": wall, "stages": stages}


def _child(kind: str, i: int) -> dict:
    env = dict(os.environ, AUTOPP_PLAN_CACHE=tempfile.mkdtemp(),
               AUTOPP_PROFILE_CACHE=tempfile.mkdtemp())
    out = subprocess.run([sys.executable, __file__, kind, "--child", kind, str(i)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} case {i} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["stages", "layouts"])
    p.add_argument("--only", type=int, default=None, help="one case (its index)")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, i = args.child
        res = _stage_case(FRACTIONS[int(i)]) if kind == "stages" else _layout_case(int(i))
        print(json.dumps(res))
        return
    n = len(FRACTIONS) if args.what == "stages" else len(LAYOUTS)
    for i in range(n) if args.only is None else [args.only]:
        r = _child(args.what, i)
        if args.what == "stages":
            print(f"budget {r['fraction']:.0%} of the fastest plan's memory "
                  f"({r['budget'] / 2**20:.2f} MiB): composed {r['composed_s'] * 1e6:.3f} us "
                  f"({r['composed_bytes'] / 2**20:.2f} MiB, bound "
                  f"{r['composed_bound_s'] * 1e6:.3f} us, {r['composed_wall_s']:.1f} s); "
                  f"whole-stage MIP {r['exact_s'] * 1e6:.3f} us "
                  f"({r['exact_bytes'] / 2**20:.2f} MiB, {r['exact_wall_s']:.1f} s); "
                  f"composed / MIP {r['composed_s'] / r['exact_s']:.4f}", flush=True)
        else:
            gaps = [(s["time_s"] - s["bound_s"]) / s["time_s"] if s["bound_s"] else 0.0
                    for s in r["stages"]]
            times = ", ".join(f"{s['time_s'] * 1e3:.3f}" for s in r["stages"])
            print(f"{r['name']}: simulated step {r['step_s'] * 1e3:.3f} ms, every rank fits: "
                  f"{r['fits']}, planned in {r['wall_s']:.1f} s; stage times (ms) "
                  f"{times}; "
                  f"recompute {','.join(s['recompute'] for s in r['stages'])}; largest gap "
                  f"to the certified bound {100 * max(gaps):.2f}% (stage "
                  f"{gaps.index(max(gaps))})", flush=True)


if __name__ == "__main__":
    main()
