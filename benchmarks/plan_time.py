"""Planning time of autopp's sharding planner on an 8-block llama3-8B-shaped stage.

    .venv/bin/python benchmarks/plan_time.py            # 8 blocks, fake 32x8 mesh, median of 3
    .venv/bin/python benchmarks/plan_time.py --lower    # also lowering it (rank 0's graph)
    .venv/bin/python benchmarks/plan_time.py --compare  # planned vs torchtitan FSDP+TP, 1 block

Each run is a fresh process (imports excluded from the timing): trace, strategy enumeration,
ILP build and solves, block chaining. The stage gets a parameter-memory budget (1/64 of its
fp32 parameters per device, so FSDP-style sharding is needed) and block boundaries may be
replicated or sequence-sharded over tp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def build_stage(n_layers: int, model_name: str = "8B"):
    """The first ``n_layers`` blocks of torchtitan's llama3 ``model_name`` as one stage, on
    meta (also used by ``plan_quality.py``)."""
    import torch
    from torch import nn
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs[model_name], "sdpa")
    with torch.device("meta"):
        model = cfg.build()

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict(dict(list(model.layers.items())[:n_layers]))

        def forward(self, x):
            for layer in self.layers.values():
                x = layer(x, None, None)
            return x

    return Stage()


def one_run(args) -> dict:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from autopp.mesh import init_fake_world
    from autopp.sharding import StageMemory, StageRequest, plan_stage

    stage = build_stage(args.layers)
    init_fake_world(args.dp * args.tp)
    mesh = DeviceMesh("cpu", torch.arange(args.dp * args.tp).view(args.dp, args.tp),
                      mesh_dim_names=("dp", "tp"))
    x = torch.empty(args.batch, args.seq, 4096, device="meta")
    budget = sum(p.numel() * p.element_size() for p in stage.parameters()) / 64
    t0 = time.perf_counter()
    plan = plan_stage(StageRequest(module=stage, example_inputs=(x,), mesh=mesh,
                                   profile=args.profile, memory=StageMemory(budget_bytes=budget),
                                   input_placements=None, output_placements=None))
    dt = time.perf_counter() - t0
    out = {"plan_s": dt, "num_vars": plan.num_vars, "solve_s": plan.solve_s,
           "step_time_ms": plan.step_time_s * 1e3, "blocks": len(plan.blocks),
           "param_MiB_per_device": plan.param_bytes_per_device / 2**20}
    if args.lower:
        out.update(lower(stage, plan, mesh, x))
    return out


def lower(stage, plan, mesh, x) -> dict:
    """Lower the planned stage to rank 0's local joint graph (what each rank does at
    ``init_weights``) and split it into a schedule's pieces, their Python code made (as at
    their first run): seconds and traces made."""
    from autopp.lower import stitch
    from autopp.lower.local_graphs import LoweredUnit, lower_stage, split_local
    from autopp.sharding.plan import from_strs
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    units = []
    for bplan, unit in zip(plan.blocks, stage_units(stage)):
        joint = trace_joint(unit.module, (x,))
        units.append(LoweredUnit(joint, bplan, tuple(unit.stage_fqn(f) for f in joint.params),
                                 tuple(joint.buffers)))
    traces = []
    real = stitch._trace_piece
    stitch._trace_piece = lambda *a: traces.append(1) or real(*a)
    t0 = time.perf_counter()
    local = lower_stage(units, mesh, from_strs(plan.input_placements),
                        from_strs(plan.output_placements))
    t1 = time.perf_counter()
    pieces = split_local(local).graphs()
    for gm in pieces.values():
        gm.code  # each piece's Python code, made when it first runs (lazy graph modules)
    t2 = time.perf_counter()
    stitch._trace_piece = real
    return {"lower_s": t1 - t0, "split_s": t2 - t1, "unit_traces": len(traces),
            "graph_nodes": len(local.gm.graph.nodes)}


def compare(args) -> None:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from autopp.mesh import init_fake_world
    from autopp.adapters.torchtitan_reference import compare_with_torchtitan
    from autopp.sharding import StageRequest

    init_fake_world(256)
    stage = build_stage(1)
    for dp, tp in ((2, 4), (8, 8), (32, 8)):
        mesh = DeviceMesh("cpu", torch.arange(dp * tp).view(dp, tp), mesh_dim_names=("dp", "tp"))
        x = torch.empty(max(dp, 8), args.seq, 4096, device="meta")
        ours, theirs = compare_with_torchtitan(StageRequest(
            module=stage, example_inputs=(x,), mesh=mesh, profile=args.profile,
            input_placements=None, output_placements=None))
        print(f"{dp}x{tp} batch {x.shape[0]} seq {args.seq}: planned "
              f"{ours.step_time_s * 1e3:.3f} ms ({ours.param_bytes_per_device / 2**20:.1f} MiB "
              f"params/device), torchtitan FSDP+TP {theirs.step_time_s * 1e3:.3f} ms "
              f"({theirs.param_bytes_per_device / 2**20:.1f} MiB)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dp", type=int, default=32)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--profile", default="H100")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--lower", action="store_true",
                    help="also lower the planned stage to rank 0's graph and split it")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        compare(args)
        return
    if args.one:
        print(json.dumps(one_run(args)))
        return
    runs = []
    for i in range(args.runs):
        out = subprocess.run([sys.executable, __file__, "--one", *sys.argv[1:]],
                             capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"run {i}: {runs[-1]}", flush=True)
    med = statistics.median(r["plan_s"] for r in runs)
    print(f"{args.layers} blocks, dim 4096, seq {args.seq}, batch {args.batch}, fake "
          f"{args.dp}x{args.tp} mesh: planning time median {med:.2f} s over {args.runs} runs, "
          f"ILP variables {runs[0]['num_vars']}, estimated step {runs[0]['step_time_ms']:.2f} ms")
    if args.lower:
        print(f"lowering rank 0's graph: median {statistics.median(r['lower_s'] for r in runs):.2f}"
              f" s ({runs[0]['unit_traces']} unit trace(s) for {runs[0]['blocks']} blocks, "
              f"{runs[0]['graph_nodes']} nodes), split into a schedule's pieces: median "
              f"{statistics.median(r['split_s'] for r in runs):.2f} s")


if __name__ == "__main__":
    main()
