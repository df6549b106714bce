"""Measured peak tensor memory of a planned pipeline, next to what its graphs say it keeps.

Launch (8 CPU processes, gloo)::

    .venv/bin/torchrun --standalone --nproc-per-node 8 benchmarks/memory.py \
        --schedule GPipe --microbatches 2,8

For each microbatch count it builds llama3 debugmodel at pp=2 x dp=2 x tp=2 with autopp's
planner under a parameter-memory budget small enough that weights are sharded over dp (the
FSDP-like case whose gathered copies matter), keeps the microbatch size fixed (the global
batch grows with the count), runs one AdamW step to create gradients and optimizer state,
then measures one more training step with torch's profiler (``profile_memory=True``): the
peak of live tensor bytes allocated during the step, from the allocator's allocation and
free events. Next to it, per rank, what the lowered graphs say the step keeps:

* ``gathered``: the unshard graph's outputs (weights gathered once per step at UNSHARD and
  held until RESHARD), independent of the microbatch count; with
  ``--reshard-after-forward regather`` they are gathered again for every forward and
  backward and held only meanwhile, so the same bytes are a transient at whatever moment
  the gather runs (in GPipe, the first backward: on top of every microbatch's activations);
* ``acts``: bytes a microbatch keeps for its backward x the microbatches in flight on the
  rank under the schedule (GPipe: all of them; 1F1B: pp - pp_rank); on the last stage
  also what the eager loss keeps (the logits and cross entropy's log-probabilities);
* ``grad acc``: the unreduced gradient accumulators (summed over microbatches, reduced once
  per step) plus the reduced gradients the step leaves in ``.grad``.

``unpredicted`` (measured - predicted) is what the graphs do not account for: transient
buffers of the op running at the peak. It must not grow with the number of microbatches
(before UNSHARD existed, every microbatch in flight kept its own gathered copy of the
weights, which would show here). The planner prices gathers once per step, so plans for
different microbatch counts may shard different weights: compare ``gathered`` too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="GPipe")
    p.add_argument("--microbatches", default="2,8", help="comma-separated counts to measure")
    p.add_argument("--mb-size", type=int, default=2, help="sequences per microbatch per dp rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--budget", type=float, default=4e6,
                   help="parameter-memory budget per device (bytes): forces dp-sharded weights")
    p.add_argument("--reshard-after-forward", default="keep", choices=["keep", "regather"],
                   help="keep the gathered weights for the step (default), or re-gather them "
                        "for every forward and backward")
    return p.parse_args()


def peak_bytes_during(fn) -> int:
    """Peak of live tensor bytes allocated while ``fn()`` runs (above the level at its
    start), from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.nbytes())
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def graph_output_bytes(gm, first: int, count: int) -> int:
    outs = gm.graph.output_node().args[0][first : first + count]
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in outs
               if hasattr(n, "meta") and isinstance(n.meta.get("val"), torch.Tensor))


def measure(args, n_mb: int) -> dict:
    from autopp import build_world_mesh, pipeline_autoparallel
    from autopp.schedules import schedule_info
    from tests.models import ce_loss, llama3_meta, make_batch

    mesh = build_world_mesh(pp=2, dp=2, tp=2)
    pp_rank, dp_rank, _ = mesh.get_coordinate()
    local = n_mb * args.mb_size
    tokens, target = make_batch(local * 2, args.seq_len)
    tok, tgt = tokens[dp_rank * local:(dp_rank + 1) * local], target[dp_rank * local:(dp_rank + 1) * local]
    from autopp.backends import Planner, PlannerOptions

    raf = args.reshard_after_forward == "regather"
    pipe = pipeline_autoparallel(
        llama3_meta(args.n_layers), mesh, example_inputs=(tok,), loss_fn=ce_loss,
        schedule=args.schedule, n_microbatches=n_mb,
        parallelize=Planner(PlannerOptions(memory_budget_bytes=args.budget,
                                           reshard_after_forward=raf)))
    pipe.init_weights(seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)

    def step() -> None:
        pipe.step(tok, target=tgt)
        opt.step()
        pipe.zero_grad()

    step()  # gradients, optimizer state, lowered graphs
    dist.barrier()
    peak = peak_bytes_during(lambda: pipe.step(tok, target=tgt))
    pipe.zero_grad()

    info = schedule_info(args.schedule)
    in_flight = n_mb if info.name in ("GPipe", "LoopedBFS") else min(n_mb, 2 - pp_rank)
    gathered = acts = grads = 0
    for m, sid in zip(pipe.stage_modules, pipe.layout.stage_ids):
        local, g = m.stage_graphs()
        gathered += m.gathered_param_bytes()
        per_mb = m.saved_bytes_per_microbatch()
        if sid == pipe.layout.n_stages - 1:
            # the eager loss keeps its input (the logits) and what cross entropy saves for
            # its backward (log-probabilities of the same size) until the microbatch's B
            per_mb += 2 * torch.Size(local.input_shapes[-1]).numel() * 4
        acts += per_mb * in_flight
        n_pg = g.convention.signature.num_param_grads
        grads += graph_output_bytes(g.full_backward_graph, 0, n_pg)  # unreduced accumulators
        grads += sum(p.to_local().numel() * p.element_size() for p in m.parameters())
    return dict(peak=peak, gathered=gathered, acts=acts, grads=grads, in_flight=in_flight,
                n_mb=n_mb, pp_rank=pp_rank)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rows = []
    for n_mb in (int(m) for m in args.microbatches.split(",")):
        rows.append(measure(args, n_mb))
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        mib = 2**20
        print(f"llama3 debugmodel ({args.n_layers} layers) pp=2 x dp=2 x tp=2, {args.schedule}, "
              f"{args.mb_size} x {args.seq_len} tokens per microbatch per dp rank, parameter "
              f"budget {args.budget / mib:.1f} MiB, gathered weights: {args.reshard_after_forward}; "
              "MiB per rank, peak measured during one step")
        print(f"{'rank':>4s} {'M':>3s} {'measured':>9s} {'predicted':>9s} {'gathered':>9s} "
              f"{'acts':>7s} {'(in flight)':>11s} {'grad acc':>9s} {'measured-acts':>13s} "
              f"{'unpredicted':>11s}")
        for rank, rs in enumerate(gathered):
            for r in rs:
                pred = r["gathered"] + r["acts"] + r["grads"]
                print(f"{rank:4d} {r['n_mb']:3d} {r['peak'] / mib:9.2f} {pred / mib:9.2f} "
                      f"{r['gathered'] / mib:9.2f} {r['acts'] / mib:7.2f} {r['in_flight']:11d} "
                      f"{r['grads'] / mib:9.2f} {(r['peak'] - r['acts']) / mib:13.2f} "
                      f"{(r['peak'] - pred) / mib:11.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
