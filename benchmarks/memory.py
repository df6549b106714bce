"""Measured peak tensor memory of a planned pipeline, next to the schedule simulator's prediction.

Launch (8 CPU processes, gloo)::

    .venv/bin/torchrun --standalone --nproc-per-node 8 benchmarks/memory.py \
        --schedule 1F1B,Interleaved1F1B --recompute none,selective,full

For each configuration (schedule x microbatch count x recomputation) it builds llama3
debugmodel at pp=2 x dp=2 x tp=2 with autopp's planner under a parameter-only budget
(``parameter_budget_bytes``, ``--budget`` per stage, times a rank's stages) small
enough that weights are sharded over dp (the FSDP-like case whose gathered copies matter),
``PlannerOptions(recompute=...)``, a fixed microbatch size (the global batch grows with the
count), runs one step and one AdamW step (gradients, optimizer state, receive buffers and
lowered graphs now exist), then measures one more training step:

* ``measured`` = the live tensor bytes when the step starts (every CPU tensor storage the
  process holds, counted once: parameters, buffers, optimizer state, receive buffers, and
  anything else) + the peak of live tensor bytes allocated during the step above that level,
  from the profiler's allocator events (``profile_memory=True``).
* ``predicted`` = :func:`autopp.schedules.simulate_schedule` on the schedule's real action
  lists, with one :class:`~autopp.schedules.StageCost` per stage from the planned stages'
  real numbers: parameter and buffer shards; AdamW's two moments and step per parameter;
  the reduced gradients and the unreduced accumulators (``full_backward``'s parameter
  gradients), which the graph runtime keeps until the next step, so both count after
  REDUCE_GRAD; the unshard graph's gathered weights (UNSHARD to RESHARD); and per
  microbatch from F to B what the forward saves that is new memory
  (:func:`~autopp.lower.memory.saved_bytes` without the stage input, which lives in
  torch's receive buffer), plus the output the runtime keeps for the backward (last stage:
  the logits and cross entropy's log-probabilities, freed at the microbatch's backward). Two terms the simulator has no field
  for are added here: the receive buffers torch allocates once per microbatch (activations
  in, gradients in: static), and each action's working memory, the peak of what its graph
  allocates while it runs (:func:`~autopp.lower.memory.graph_peak_bytes`: the backward's
  intermediates and new gradients; with recomputation, the recomputed forward), on top of
  the simulated level during that action.

``--details`` prints the prediction's parts at the predicted peak and the measured level
at the step's start next to the predicted static bytes.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="1F1B,Interleaved1F1B",
                   help="comma-separated schedules to measure")
    p.add_argument("--microbatches", default="8", help="comma-separated counts to measure")
    p.add_argument("--recompute", default="none,full",
                   help="comma-separated PlannerOptions.recompute values (none, selective, full)")
    p.add_argument("--mb-size", type=int, default=2, help="sequences per microbatch per dp rank")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--budget", type=float, default=5e6,
                   help="parameter budget per stage (parameters alone; a rank's stages "
                        "share budget x stages per rank): forces dp-sharded weights")
    p.add_argument("--weight-gathering", default="once_per_step,per_block",
                   help="comma-separated PlannerOptions.weight_gathering policies to measure "
                        "side by side: once_per_step (gathered copy kept all step) and/or "
                        "per_block (FSDP's: gathered and reduced block by block)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (dp = 4 // pp, tp = 2)")
    p.add_argument("--details", action="store_true", help="print the prediction's parts")
    return p.parse_args()


# -- measurement ---------------------------------------------------------------------------

def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage this process holds (each storage once)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:
            st = obj.untyped_storage()
            if st.device.type == "cpu" and st.data_ptr():
                storages[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # wrapper subclasses (DTensor: its local tensor is counted) and fakes
    return sum(storages.values())


def peak_bytes_during(fn) -> int:
    """Peak of live tensor bytes allocated while ``fn()`` runs (above the level at its
    start), from the profiler's allocator events.

    The profiler records a free only on the threads it follows: a tensor whose last
    reference goes on one of gloo's threads (a collective's work object letting go of its
    output) leaves no free event, and counting it live to the end would raise the peak by
    whatever such tensors accumulate, differently on each run. An allocation at an address
    still counted live shows that the tensor there was freed: it is counted freed then."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        stack += node.children
    events.sort(key=lambda e: (e[0], e[1]))  # frees first at equal times
    held: dict[int, int] = {}
    live = peak = 0
    for _, n, ptr in events:
        if n > 0:
            live += n - held.get(ptr, 0)  # an unrecorded free of what was there before
            held[ptr] = n
        else:
            live -= held.pop(ptr, -n)
        peak = max(peak, live)
    return peak


# -- prediction ----------------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _local_bytes(tensors) -> int:
    return sum(_nbytes(t.to_local() if hasattr(t, "to_local") else t) for t in tensors)


def _out_bytes(gm, first: int, count: int) -> int:
    outs = gm.graph.output_node().args[0][first: first + count]
    return sum(_nbytes(n.meta["val"]) for n in outs
               if hasattr(n, "meta") and isinstance(n.meta.get("val"), torch.Tensor))


def stage_numbers(m, sid: int, local_ids: list[int], n_stages: int, n_mb: int,
                  per_block: bool = False) -> dict:
    """What one planned stage holds, read off the lowered graphs it runs (per block: the
    gathers and reductions inside F, I, W and B, whose working memory counts them) and its
    parameters."""
    from autopp.lower.memory import graph_peak_bytes, saved_bytes
    from autopp.schedules.memory_terms import receive_buffer_bytes

    local, g = m.stage_graphs()
    if per_block:
        g = m.per_block_graphs()
    sig = g.convention.signature
    params = [p for p in m.parameters()]
    p_bytes = _local_bytes(params)
    n_state = local.signature.num_state_inputs
    in_bytes = torch.Size(local.input_shapes[n_state]).numel() * 4 if sid > 0 else 0
    out_bytes = torch.Size(local.input_shapes[-1]).numel() * 4  # the output's (gradient's) size
    fw_out = g.forward_graph.graph.output_node().args[0]
    is_last = sid == n_stages - 1
    new_saved = saved_bytes(g, include_inputs=False)
    if is_last:
        # the eager loss: cross entropy saves the log-probabilities until B, and the logits
        # leaf with them (the runtime keeps a detached loss, which holds neither)
        acts, to_end_f = new_saved + out_bytes, 0
    else:
        # an output sent to another rank stays until the step ends: torch's runtime waits on
        # its sends only then, and each send holds its tensor; else the runtime keeps it
        # until the microbatch's backward
        sent = sid + 1 not in local_ids
        saved_too = fw_out[0] in set(fw_out[sig.num_outputs:])
        if sent:
            acts, to_end_f = new_saved - (out_bytes if saved_too else 0), out_bytes
        else:
            acts, to_end_f = new_saved + (0 if saved_too else out_bytes), 0
    # the input gradient sent back stays until the step ends as well
    to_end_b = in_bytes if sid > 0 and sid - 1 not in local_ids else 0
    unreduced = _out_bytes(g.full_backward_graph, 0, sig.num_param_grads)
    fw_new = _out_bytes(g.forward_graph, 0, len(fw_out))  # its outputs, as allocated
    loss_grad = out_bytes if is_last else 0  # the logits' gradient the graphs' backward reads
    work = {
        "F": max(0, graph_peak_bytes(g.forward_graph) - fw_new),
        "B": graph_peak_bytes(g.full_backward_graph) + loss_grad,
    }
    if g.backward_input_graph is not None:
        work["I"] = graph_peak_bytes(g.backward_input_graph) + loss_grad
        work["W"] = graph_peak_bytes(g.backward_weight_graph)
    if g.unshard_graph is not None:
        work["UNSHARD"] = max(0, graph_peak_bytes(g.unshard_graph) - m.gathered_param_bytes())
    if g.reduce_grad_graph is not None:
        work["REDUCE_GRAD"] = graph_peak_bytes(g.reduce_grad_graph)
    return dict(
        params=p_bytes + _local_bytes(m.buffers()),
        optimizer=2 * p_bytes + 4 * len(params),  # AdamW: exp_avg, exp_avg_sq, step
        grads=p_bytes, unreduced=unreduced,
        gathered=0 if per_block else m.gathered_param_bytes(), acts=acts,
        p2p=receive_buffer_bytes(n_mb, in_bytes, 0 if is_last else out_bytes),
        to_end_f=to_end_f, to_end_b=to_end_b,
        work=work, saved_with_inputs=saved_bytes(g),
    )


def predict(numbers: dict[int, dict], schedule: str, pp: int, pp_rank: int, n_mb: int,
            n_stages: int) -> dict:
    """Predicted peak bytes of this pp rank: the simulated timeline, the working memory of
    the action running at each moment on top of it, and the static receive buffers."""
    from autopp.schedules import StageCost, simulate_schedule

    def cost(s: int) -> StageCost:
        n = numbers.get(s)
        times = dict(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0)
        if n is None:  # another rank's stage: only its timing matters here
            return StageCost(**times)
        return StageCost(
            **times, activation_bytes_per_microbatch=n["acts"], param_bytes=n["params"],
            grad_bytes=n["grads"] + n["unreduced"], unreduced_grad_bytes=n["unreduced"],
            optimizer_bytes=n["optimizer"], gathered_param_bytes=n["gathered"])

    sim = simulate_schedule(schedule, [cost(s) for s in range(n_stages)], pp=pp,
                            n_microbatches=n_mb, n_stages=n_stages)
    tl = sim.memory[pp_rank]
    totals = tl.total()
    at = max(range(len(totals)), key=totals.__getitem__)
    best, what = totals[at], None
    held = 0  # sent tensors, kept until the step ends
    mine = sorted((e for e in sim.events if e.rank == pp_rank and e.stage in numbers),
                  key=lambda e: (e.start_s, e.end_s))
    for e in mine:
        n = numbers[e.stage]
        if e.kind == "F":
            held += n["to_end_f"]
        extra = n["work"].get(e.kind, 0) + held
        i0 = max(i for i, t in enumerate(tl.times_s) if t <= e.start_s)
        during = [i0] + [i for i, t in enumerate(tl.times_s) if e.start_s < t < e.end_s]
        i = max(during, key=totals.__getitem__)
        if totals[i] + extra > best:
            best, at, what = totals[i] + extra, i, (e.action, extra)
        if e.kind in ("B", "I"):
            held += n["to_end_b"]
    p2p = sum(n["p2p"] for n in numbers.values())
    parts = {c: tl.bytes[c][at] for c in tl.bytes}
    return dict(predicted=best + p2p, p2p=p2p, at_action=what, parts=parts,
                static=sum(n["params"] + n["optimizer"] for n in numbers.values()) + p2p)


def plan_estimate(pipe, args, mesh, pp_rank: int, gathering: str) -> dict | None:
    """The plan's own estimate for this pp rank (:func:`autopp.estimate.pipeline.estimate_plan`,
    computed on rank 0 and broadcast): its peak and its categories at the peak, with the
    categories the simulator had before the memory terms of issue 26 (parameters, gradients,
    optimizer, gathered parameters, activations) summed apart."""
    from autopp.estimate.pipeline import estimate_plan
    from autopp.graph.weight_gathering import WeightGathering
    from autopp.integrations.torchtitan.estimates import estimates_on_rank0
    from autopp.mesh import stage_sub_mesh
    from tests.harness.models import llama3_meta

    plan = pipe.backend.pipeline_plan
    est, why = estimates_on_rank0(lambda: estimate_plan(
        plan, llama3_meta(args.n_layers), stage_sub_mesh(mesh),
        gathering=WeightGathering(per_block=gathering == "per_block")).estimates)
    if est is None:
        print(f"rank {dist.get_rank()}: no plan estimate ({why})", flush=True)
        return None
    cats = dict(est.memory_at_peak[pp_rank])
    old = ("parameters", "gradients", "optimizer", "gathered_parameters", "activations")
    return dict(peak=est.peak_bytes[pp_rank], cats=cats, old=sum(cats[c] for c in old))


def measure(args, schedule: str, n_mb: int, recompute: str, gathering: str) -> dict:
    from autopp import build_world_mesh, pipeline_autoparallel
    from autopp.backends import Planner, PlannerOptions
    from autopp.schedules.registry import default_n_stages
    from tests.harness.models import ce_loss, llama3_meta, make_batch

    pp = args.pp
    mesh = build_world_mesh(pp=pp, dp=4 // pp, tp=2)
    pp_rank, dp_rank, _ = mesh.get_coordinate()
    local = n_mb * args.mb_size
    tokens, target = make_batch(local * (4 // pp), args.seq_len)
    tok = tokens[dp_rank * local:(dp_rank + 1) * local].clone()
    tgt = target[dp_rank * local:(dp_rank + 1) * local].clone()
    del tokens, target
    pipe = pipeline_autoparallel(
        llama3_meta(args.n_layers), mesh, example_inputs=(tok,), loss_fn=ce_loss,
        schedule=schedule, n_microbatches=n_mb,
        parallelize=Planner(PlannerOptions(
            # the budget is per device, shared by the rank's stages: --budget is per stage
            parameter_budget_bytes=args.budget * default_n_stages(schedule, pp) // pp,
            recompute=recompute, weight_gathering=gathering)))
    pipe.init_weights(seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.step(tok, target=tgt)  # gradients, optimizer state, receive buffers, lowered graphs
    opt.step()
    pipe.zero_grad()
    dist.barrier()
    start = live_tensor_bytes()
    peak = peak_bytes_during(lambda: pipe.step(tok, target=tgt))
    pipe.zero_grad()

    t0 = time.perf_counter()
    pipe.step(tok, target=tgt)  # timed apart from the profiled step
    step_s = time.perf_counter() - t0
    pipe.zero_grad()
    plan_est = plan_estimate(pipe, args, mesh, pp_rank, gathering)
    n_stages = pipe.layout.n_stages
    ids = list(pipe.layout.stage_ids)
    numbers = {sid: stage_numbers(m, sid, ids, n_stages, n_mb, gathering == "per_block")
               for m, sid in zip(pipe.stage_modules, pipe.layout.stage_ids)}
    pred = predict(numbers, schedule, pp, pp_rank, n_mb, n_stages)
    del pipe, opt
    gc.collect()
    return dict(schedule=schedule, n_mb=n_mb, recompute=recompute, gathering=gathering,
                step_s=step_s, start=start, peak=peak,
                measured=start + peak, **pred, plan_est=plan_est,
                acts=sum(n["acts"] for n in numbers.values()),
                saved=sum(n["saved_with_inputs"] for n in numbers.values()))


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rows = []
    for schedule, n_mb, recompute, gathering in itertools.product(
            args.schedule.split(","), (int(m) for m in args.microbatches.split(",")),
            args.recompute.split(","), args.weight_gathering.split(",")):
        rows.append(measure(args, schedule, n_mb, recompute, gathering))
        dist.barrier()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rows)
    if dist.get_rank() == 0:
        print(f"llama3 debugmodel ({args.n_layers} layers) pp={args.pp} x dp={4 // args.pp} "
              "x tp=2, "
              f"{args.mb_size} x {args.seq_len} tokens per microbatch per dp rank, parameter "
              f"budget {args.budget / MIB:.1f} MiB a stage; MiB per rank: measured = live at "
              "step start + profiler peak during the step; predicted = simulator + receive buffers "
              "+ working memory of the running action; step ratio: the same without what is "
              "held before the step (measured: its peak above the start; predicted: minus "
              "parameters, buffers, optimizer state and receive buffers)")
        print(f"{'config':<40s} {'rank':>4s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s} "
              f"{'step ratio':>10s} {'acts/mb':>8s} {'peak at':>8s} {'step s':>7s}")
        for i in range(len(rows)):
            for rank, rs in enumerate(per_rank):
                r = rs[i]
                cfg = f"{r['schedule']} M={r['n_mb']} {r['recompute']} {r['gathering']}"
                action = r["at_action"][0] if r["at_action"] else "-"
                step_ratio = r["peak"] / (r["predicted"] - r["static"])
                print(f"{cfg:<40s} {rank:4d} {r['measured'] / MIB:9.2f} "
                      f"{r['predicted'] / MIB:9.2f} {r['measured'] / r['predicted']:6.3f} "
                      f"{step_ratio:10.3f} {r['acts'] / MIB:8.2f} {action:>8s} "
                      f"{r['step_s']:7.3f}")
                e = r["plan_est"]
                if e is not None:
                    parts = " ".join(f"{k}={v / MIB:.2f}" for k, v in e["cats"].items() if v)
                    print(f"{'':<28s}      plan estimate {e['peak'] / MIB:.2f} MiB (measured / "
                          f"estimate {r['measured'] / e['peak']:.3f}; the five categories "
                          f"before issue 26's terms {e['old'] / MIB:.2f}): {parts}")
                if args.details:
                    parts = " ".join(f"{k}={v / MIB:.2f}" for k, v in r["parts"].items())
                    work = r["at_action"][1] / MIB if r["at_action"] else 0.0
                    print(f"{'':<28s}      start measured {r['start'] / MIB:.2f} vs static "
                          f"predicted {r['static'] / MIB:.2f}; step peak {r['peak'] / MIB:.2f}; "
                          f"at the predicted peak: {parts} work={work:.2f} "
                          f"p2p={r['p2p'] / MIB:.2f}; saved/mb incl. inputs "
                          f"{r['saved'] / MIB:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
