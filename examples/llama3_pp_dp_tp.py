"""Train torchtitan's llama3 with autopp: pipeline x data x tensor parallel.

Run on 8 CPU processes (gloo), pp=2 x dp=2 x tp=2 (what ``bash scripts/example.sh`` does)::

    .venv/bin/torchrun --standalone --nproc-per-node 8 examples/llama3_pp_dp_tp.py \
        --pp 2 --dp 2 --tp 2 --device cpu

Each stage is sharded over its dp x tp sub-mesh by autopp's planner (``--parallelize auto``,
the default; plans are printed at start and cached on disk). A dry run plans a big model for
many ranks on one machine, with no devices::

    .venv/bin/python examples/llama3_pp_dp_tp.py --dry-run --model 8B --pp 4 --dp 8 --tp 8 \
        --batch-size 64 --seq-len 2048 --microbatches 8 --trace step.json --timeline step.png

It reports the simulated step time of the schedule, each pipeline rank's peak memory by
category and whether it fits the device profile's memory (``--memory-reserve`` kept back).

A search chooses the layout (pp x dp x tp, schedule, microbatches, split, recomputation) for
a number of devices, prints the fastest candidates, plans the best one exactly and writes it
(``--save-plan``, JSON) with its simulated step (``--trace``/``--timeline``)::

    .venv/bin/python examples/llama3_pp_dp_tp.py --search --model 70B --world 512 \
        --batch-size 512 --seq-len 8192 --mixed-precision bf16 --save-plan best.json

``--plan best.json`` trains with a saved plan (its layout, schedule and split); launched
without ``--pp/--dp/--tp`` (and no ``--plan``), the example searches for the world size
torchrun gives it, on rank 0, and trains with the best layout.

The model is torchtitan's llama3 (``--model``: debugmodel, 1B, 3B, 8B, 70B, 405B) with SDPA
attention, built on the meta device: each rank materialises only its own stages. It learns
bytes (token = byte, 0..255) of the Python standard library's sources, or of ``--data FILE``.
The global batch of each step is the same whatever ``--dp`` is; each dp rank trains on its
rows. Rank 0 logs loss, throughput, step time, memory and gradient norm, as torchtitan does.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torchtitan.models.llama3 import llama3_configs

from autopp import PlannerOptions, build_world_mesh, cross_entropy, pipeline_autoparallel
from autopp.layout_search.exact import TRIES
from autopp.models import torchtitan_model
from data import VOCAB_SIZE, ByteBatches, load_corpus

IGNORE_INDEX = -100


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="debugmodel", choices=list(llama3_configs))
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree "
                   "(none of the three: searched for the world size, or 2 x 2 x 2 for "
                   "--dry-run)")
    p.add_argument("--schedule", default="1F1B",
                   help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                        "ZBVZeroBubble, DualPipeV, or a schedule .csv file")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--split", default=None,
                   help="stage split: a number of stages or a layout string such as "
                        "'Ettt|tttL' (default: uniform)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=3, help="linear learning-rate warmup steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="train on this file's bytes instead")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--parallelize", default="auto", choices=["auto", "replicate"],
                   help="auto: the planner shards each stage over its dp x tp sub-mesh; "
                        "replicate: each stage replicated over its sub-mesh")
    p.add_argument("--profile", default=None,
                   help="device profile the planner assumes (H100, H200, A100, CPU); "
                        "default: CPU on --device cpu, else H100; H100 for --dry-run")
    p.add_argument("--loss-parallel", default="auto", choices=["auto", "on", "off"],
                   help="with --parallelize auto: keep the logits split on the vocabulary over "
                        "tp and compute the loss in parallel (auto: the planner's cost decides)")
    p.add_argument("--boundary", default="auto", choices=["auto", "batch", "batch+seq"],
                   help="with --parallelize auto: placement of activations between stages")
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16"],
                   help="with --parallelize auto: bf16 compute with fp32 masters and fp32 "
                        "gradient reduction (torch's MixedPrecisionPolicy)")
    p.add_argument("--compile", action="store_true",
                   help="with --parallelize auto: run each planned stage's graphs through "
                        "Inductor (cold compile: tens of seconds; see README for its effect)")
    p.add_argument("--weight-gathering", default="once_per_step",
                   choices=["once_per_step", "per_block"],
                   help="with --dry-run: how planned stages hold their dp-sharded weights "
                        "(PlannerOptions.weight_gathering)")
    p.add_argument("--dry-run", action="store_true",
                   help="plan every stage for pp x dp x tp ranks on this one machine (fake "
                        "process group, no devices), simulate the schedule over the plans' "
                        "costs and print the plans, step time and per-rank memory; no training")
    p.add_argument("--trace", default=None, metavar="PATH.json",
                   help="with --dry-run: write the simulated step as a Chrome/Perfetto trace")
    p.add_argument("--timeline", default=None, metavar="PATH.png",
                   help="with --dry-run: draw the simulated step as a PNG timeline")
    p.add_argument("--memory-reserve", type=float, default=0.1,
                   help="with --dry-run: fraction of the device memory kept back when checking "
                        "that each rank's simulated peak fits")
    p.add_argument("--search", action="store_true",
                   help="search the layout for --world devices on this machine (fake process "
                        "group), print the fastest candidates and plan the best exactly")
    p.add_argument("--world", type=int, default=None,
                   help="with --search: the number of devices (default: pp x dp x tp)")
    p.add_argument("--top", type=int, default=10, help="with --search: candidates printed")
    p.add_argument("--save-plan", default=None, metavar="PATH.json",
                   help="with --search or --dry-run: write the planned pipeline (JSON)")
    p.add_argument("--plan", default=None, metavar="PATH.json",
                   help="train with this saved plan (its pp, dp, tp, schedule, microbatches "
                        "and split) instead of planning")
    args = p.parse_args()
    if args.split is not None and args.split.isdigit():
        args.split = int(args.split)
    return args


def init_distributed(device_type: str) -> torch.device:
    """Join the torchrun job: gloo on CPU, nccl on GPUs (one per local rank)."""
    if device_type == "cuda":
        from autopp.mesh import bind_local_device

        device = bind_local_device()  # LOCAL_RANK's GPU; an error when it is not set
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return device


def build_model(name: str) -> torch.nn.Module:
    """torchtitan's llama3 preset ``name`` with SDPA attention, on the meta device."""
    model = torchtitan_model("llama3", name)
    vocab = model.tok_embeddings.num_embeddings
    if vocab < VOCAB_SIZE:
        raise ValueError(f"{name}'s vocabulary ({vocab}) is smaller than a byte's")
    return model


def mp_policy(args):
    """torch's MixedPrecisionPolicy for --mixed-precision (None: full precision)."""
    if args.mixed_precision == "none":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Learning-rate multiplier: linear warmup to 1, then linear decay to 0.1 at the end."""
    if step < warmup:
        return (step + 1) / warmup
    return 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/status") as f:  # VmHWM: peak RSS, in kB
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 2**20


def log0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def print_in_pp_order(pipe, mesh) -> None:
    """Each pipeline rank's summary (its stages and their plans), printed by its first rank."""
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
    for r in range(mesh.shape[0]):
        if pp_rank == r and dp_rank == 0 and tp_rank == 0:
            print(pipe.describe() if r == 0 else pipe.describe().split("\n", 1)[1], flush=True)
        dist.barrier()


def _layout_defaults(args, world: int | None = None) -> None:
    """--pp/--dp/--tp not given: 2 x 2 x 2 (dry run), or what --world implies for tp=dp=1."""
    if args.pp is None and args.dp is None and args.tp is None:
        args.pp, args.dp, args.tp = 2, 2, 2
    args.pp, args.dp, args.tp = args.pp or 1, args.dp or 1, args.tp or 1


def run_search(model, args, world: int):
    """autopp.search for ``world`` devices; prints the table and returns the report."""
    import autopp

    profile = args.profile or ("H100" if args.search or args.device == "cuda" else "CPU")
    report = autopp.search(model, world_size=world, global_batch=args.batch_size,
                           seq_len=args.seq_len, options=PlannerOptions(
                               profile=profile, mixed_precision=mp_policy(args),
                               memory_reserve=args.memory_reserve))
    print(report)
    return report


def search(args) -> None:
    """Search the layout for --world devices, plan the best exactly, print and save it."""
    world = args.world or ((args.pp or 1) * (args.dp or 1) * (args.tp or 1))
    if world <= 1 and not args.world:
        raise SystemExit("--search needs --world N (the number of devices to lay out)")
    model = build_model(args.model)
    report = run_search(model, args, world)
    if not report.results:
        raise SystemExit(report.no_fit_message())
    # the best layout planned exactly, or the next-ranked ones when it does not fit
    # (autopp.layout_search.exact: the search ranks from probe costs)
    from autopp.layout_search.exact import plan_ranked

    result = plan_ranked(report, trace=args.trace, timeline=args.timeline)
    exact, over = result.report, list(result.over)
    for line in result.skipped:
        print(f"\nskipped: {line}")
    if exact is None:
        raise SystemExit(f"none of the {min(TRIES, len(report.results))} best-ranked layouts "
                         "has an exact plan that fits (above); raise --world or lower "
                         "--batch-size / --seq-len")
    which = "The best layout" if result.rank == 0 else f"Layout {result.rank + 1} of the ranking"
    print(f"\n{which}, planned exactly (each stage planned under its share of the device "
          "memory):")
    print_dry_run(exact, args)
    if over:
        print(f"\nWARNING: this exact plan does not fit: pp ranks {over} are over the usable "
              "memory at their simulated peak (table above)")


def print_dry_run(report, args) -> None:
    """A dry run's report, and where its plan, trace and timeline were written."""
    print(report)
    if args.save_plan:
        print(f"plan written to {report.plan.save(args.save_plan)}")
    for what, path in (("trace", args.trace), ("timeline", args.timeline)):
        if path:
            print(f"simulated step {what}: {path}")


def _search_in_child(model_name: str, args_dict: dict, world: int) -> str:
    """Run in a fresh process (its own fake process group): the best plan, as JSON."""
    args = argparse.Namespace(**args_dict)
    report = run_search(build_model(model_name), args, world)
    return report.plan(0).plan.to_json()


def searched_plan(args, world: int):
    """Rank 0 searches (in a child process, off the job's process group) and every rank
    gets the best plan."""
    import multiprocessing

    from autopp import PipelinePlan
    from autopp.plan.rank0 import broadcast_from_rank0

    def search() -> str:
        try:
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                return pool.apply(_search_in_child, (args.model, vars(args), world))
        except Exception as e:  # every rank says why, not only rank 0
            raise ValueError(f"the layout search for {world} devices failed: {e}") from None

    # the other ranks wait on a long-timeout CPU group (a 70B search outlasts NCCL's watchdog)
    return PipelinePlan.from_json(broadcast_from_rank0(search, what="searching layouts"))


def use_plan(args, plan) -> None:
    """Take the layout, schedule, microbatches and split from a plan."""
    args.pp, args.dp, args.tp = plan.pp, plan.dp, plan.tp
    args.schedule, args.microbatches = plan.schedule, plan.n_microbatches
    args.split = [list(f) for f in plan.fqns_per_stage]


def dry_run(args) -> None:
    """Plan the whole pipeline on this machine alone and print the report."""
    from autopp.dry_run import dry_run as dry_run_

    _layout_defaults(args)
    report = dry_run_(
        build_model(args.model), pp=args.pp, dp=args.dp, tp=args.tp,
        schedule=args.schedule, n_microbatches=args.microbatches,
        global_batch=args.batch_size, seq_len=args.seq_len,
        split=args.split, trace=args.trace, timeline=args.timeline,
        options=PlannerOptions(
            profile=args.profile or "H100", boundary=args.boundary,
            loss_parallel={"auto": None, "on": True, "off": False}[args.loss_parallel],
            mixed_precision=mp_policy(args), memory_reserve=args.memory_reserve,
            weight_gathering=args.weight_gathering),
    )
    print_dry_run(report, args)


def _leave_without_teardown() -> None:
    """End a planning-only run (--search, --dry-run) once its report is out: the exit
    handlers run, but not the interpreter's teardown, whose last garbage collection walks
    the whole planning heap (about 2 s of the 70B pp4 dry run's ~22 s on a 2-core machine,
    py-spy) only to free memory the process is about to give back anyway."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # logging's flush, multiprocessing's joins, torch's hooks
    os._exit(0)


def main() -> None:
    """Run the example; an error that ends the job prints one line per rank (set
    AUTOPP_TRACEBACK=1 for the traceback)."""
    try:
        _main()
    except (ValueError, RuntimeError) as e:
        if os.environ.get("AUTOPP_TRACEBACK"):
            raise
        # one write (atomic on a pipe): ranks' lines do not interleave
        sys.stderr.write(f"[rank {os.environ.get('RANK', 0)}] error: {e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def _main() -> None:
    args = parse_args()
    logging.basicConfig(
        level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
        format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S",
    )
    if args.search or args.dry_run:
        (search if args.search else dry_run)(args)
        return _leave_without_teardown()
    device = init_distributed(args.device)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    plan = None
    if args.plan:
        from autopp import PipelinePlan

        plan = PipelinePlan.load(args.plan)
    elif args.pp is None and args.dp is None and args.tp is None:
        plan = searched_plan(args, dist.get_world_size())
    if plan is not None:
        use_plan(args, plan)
        log0(f"layout from the plan: pp={plan.pp} dp={plan.dp} tp={plan.tp} "
             f"{plan.schedule} with {plan.n_microbatches} microbatches")
    _layout_defaults(args)
    mesh = build_world_mesh(pp=args.pp, dp=args.dp, tp=args.tp, device_type=args.device)

    corpus = load_corpus(args.data)
    data = ByteBatches(corpus, args.seq_len, args.batch_size, seed=args.seed)
    example_inputs, _ = data.get(0, mesh["dp"].get_local_rank(), args.dp)

    model = build_model(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    pipe = pipeline_autoparallel(
        model,
        mesh,
        example_inputs=(example_inputs,),
        loss_fn=cross_entropy,  # mean next-token CE; the planner may run it in parallel over tp
        ignore_index=IGNORE_INDEX,
        schedule=args.schedule,
        n_microbatches=args.microbatches,
        split=args.split,
        plan=plan,
        parallelize="auto" if args.parallelize == "auto" else None,
        **(dict(options=PlannerOptions(
                    profile=args.profile,
                    loss_parallel={"auto": None, "on": True, "off": False}[args.loss_parallel],
                    boundary=args.boundary, mixed_precision=mp_policy(args)),
                compile=args.compile)
           if args.parallelize == "auto" else {}),
    )
    del model  # the meta-device whole model; each rank keeps only its stages
    pipe.init_weights(seed=args.seed)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.warmup, args.steps)
    )

    log0(f"llama3 {args.model}: {n_params / 1e6:.2f} M parameters; corpus "
         f"{len(corpus) / 2**20:.1f} MiB ({args.data or 'Python stdlib sources'})")
    print_in_pp_order(pipe, mesh)
    tokens_per_step = args.batch_size * args.seq_len
    times = []
    for step in range(1, args.steps + 1):
        inputs, labels = data.get(step, pipe.dp_rank, pipe.dp_size)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = pipe.step(inputs.to(device), target=labels.to(device))
        grad_norm = pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        if step % args.log_every == 0 or step == args.steps:
            log0(f"step {step:4d}  loss {loss:7.4f}  grad_norm {grad_norm:6.3f}  "
                 f"tps {tokens_per_step / dt:7.0f}  step_time {dt:6.3f}s  "
                 f"memory {peak_memory_gib(device):5.2f}GiB")

    inputs, labels = data.get(0, pipe.dp_rank, pipe.dp_size, split="eval")
    eval_loss = pipe.eval(inputs.to(device), target=labels.to(device))
    steady = statistics.median(times[1:] or times)  # the first step builds the schedule
    log0(f"done: {args.steps} steps, median step {steady:.3f}s; "
         f"held-out loss {eval_loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
