"""Step time of autopp against torchtitan's own pipeline, same layout, schedule and data.

Launch (8 CPU processes, gloo)::

    .venv/bin/torchrun --standalone --nproc-per-node 8 benchmarks/vs_torchtitan.py \
        --pp 2 --dp 2 --tp 2 --schedule 1F1B --steps 12 --warmup 2

On one 8-GPU node (NCCL), as the prepared GPU check's node mode runs it
(``bash scripts/gpu_check.sh --node``; ``--node --cpu`` runs the same on 8 gloo processes)::

    torchrun --standalone --nproc-per-node 8 benchmarks/vs_torchtitan.py --device cuda \
        --pp 2 --dp 2 --tp 2 --schedule 1F1B --runs torchtitan,autopp-auto \
        --max-loss-rel 1e-4

In one launch it trains llama3 (SDPA attention) for ``--steps`` steps with each of:

* ``torchtitan``: ``pipeline_llm`` + ``parallelize_llama`` (FSDP over dp, TP with sequence
  parallelism over tp), driven without its Trainer;
* ``autopp``: ``pipeline_autoparallel`` with ``parallelize=None`` (each stage replicated over
  its dp x tp sub-mesh: the tp ranks compute redundantly);
* ``autopp-auto``: ``pipeline_autoparallel`` with ``parallelize="auto"`` (autopp's planner
  shards each stage over its dp x tp sub-mesh; CPU device profile);
* ``autopp-auto-no-overlap``: the same with ``PlannerOptions(overlap_collectives=False)``
  (every collective waited right after it is issued, as traced; for the overlap pass's
  effect side by side with ``autopp-auto``);
* ``autopp-auto-compile``: the same, each planned stage's graphs compiled by Inductor
  (``compile=True``; the first steps include the cold compile: raise ``--warmup``);
* ``autopp+titan``: ``pipeline_autoparallel`` with a ``parallelize`` callable that applies
  torchtitan's own TP + FSDP to each stage module (like for like with ``torchtitan``).

and prints, on rank 0, the median step time of each (warmup steps dropped) and its ratio to
torchtitan's (below 1: autopp is faster). All runs start from the same weights (autopp's
split-independent init) and see the same batches, so their losses must agree step by step:
the last column is a correctness cross-check. This is a script, not a timed test: CPU
timings on shared machines are noisy.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.data import ByteBatches, load_corpus  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="debugmodel")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (samples)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--runs", default="torchtitan,autopp,autopp-auto,autopp+titan",
                   help="comma-separated subset of: " + ", ".join(RUNNERS))
    p.add_argument("--max-loss-rel", type=float, default=None, metavar="TOL",
                   help="fail (exit 1) unless every run's loss is within TOL of the first "
                        "run's (torchtitan's, when it runs), relative, at every step")
    return p.parse_args()


# ---------------------------------------------------------------- torchtitan's own pipeline


def titan_model_config(args):
    """torchtitan's llama3 preset with SDPA attention and its TP/SP sharding declared."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    parallelism = ParallelismConfig(
        data_parallel_shard_degree=args.dp,
        tensor_parallel_degree=args.tp,
        pipeline_parallel_degree=args.pp,
        pipeline_parallel_schedule=args.schedule,
        pipeline_parallel_microbatch_size=args.batch_size // args.dp // args.microbatches,
        # The default "spmd_types" backend needs FSDP support that torch 2.13 lacks
        # (fully_shard rejects its annotated plain-tensor parameters); DTensor TP it is.
        spmd_backend="partial_dtensor",
    )
    cfg = build_decoder_config_for_backend(llama3_configs[args.model], "sdpa")
    # Any object with a ``parallelism`` field will do (see Decoder.Config.update_from_config).
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    return cfg, parallelism


def titan_parallel_dims(parallelism, world_size: int):
    """torchtitan's ParallelDims with its meshes built on CPU.

    torchtitan picks its mesh device type at import time and says "cuda" when there is no
    accelerator; ParallelDims reads that module-level name, so on CPU we point it at "cpu".
    """
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    if not torch.cuda.is_available():
        tt_parallel_dims.device_type = "cpu"
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    set_spmd_backend(parallelism.spmd_backend)  # read by torchtitan's loss
    return dims


def titan_force_sum_reduction(modules) -> None:
    """gloo has no PREMUL_SUM; make FSDP reduce gradients with plain sums."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


def run_torchtitan(args, data: ByteBatches, device: torch.device) -> dict:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import utils as tt_dist
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    from autopp import init_module_

    cfg, parallelism = titan_model_config(args)
    dims = titan_parallel_dims(parallelism, dist.get_world_size())
    training = TrainingConfig(
        local_batch_size=args.batch_size // args.dp,
        seq_len=args.seq_len,
        mixed_precision_param="float32",  # autopp trains in fp32 too
    )
    # torchtitan's loss is a token sum divided by the global token count (passed in).
    ce = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size))
    n_tokens = torch.tensor(args.batch_size * args.seq_len, device=device)

    def loss_fn(pred, labels):
        return ce(pred, labels, n_tokens)

    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = cfg.build()
    schedule, parts, has_first, has_last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="/tmp",
        device=device,
        model_config=cfg,
        parallelize_fn=parallelize_llama,
        loss_fn=loss_fn,
    )
    del model
    for m in parts:
        # autopp's split-independent init, so both sides start from the same weights and
        # their losses can be compared step by step (init is outside the timed steps).
        init_module_(m, seed=args.seed, device=device)
        m.train()
    titan_force_sum_reduction(parts)
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr)
    pp_mesh = dims.get_mesh("pp")
    batch_mesh = dims.get_mesh("batch")
    tp_rank = dims.get_mesh("tp").get_local_rank() if args.tp > 1 else 0
    spmd_context = tt_dist.get_spmd_context(parallel_dims=dims)

    times, losses = [], []
    for step in range(args.steps):
        inputs, labels = data.get(step, batch_mesh.get_local_rank(), batch_mesh.size())
        inputs, labels = inputs.to(device), labels.to(device)
        dist.barrier()
        t0 = time.perf_counter()
        with spmd_context():
            step_losses = [] if has_last else None
            schedule.step(
                *((inputs,) if has_first else ()),
                target=labels if has_last else None,
                losses=step_losses,
            )
        tt_dist.clip_grad_norm_(params, 1.0, foreach=True, pp_mesh=pp_mesh)
        opt.step()
        opt.zero_grad()
        # Global mean loss: last-stage ranks hold token-sum / global tokens per microbatch.
        mine = sum(float(x) for x in step_losses) if has_last and tp_rank == 0 else 0.0
        total = torch.tensor(mine, device=device)
        dist.all_reduce(total)
        times.append(time.perf_counter() - t0)
        losses.append(total.item())
    return {"times": times, "losses": losses}


# ---------------------------------------------------------------- autopp


def titan_parallelize_fn(args, dims, parallelism):
    """A ``parallelize`` callable for autopp that applies torchtitan's TP + FSDP to a stage.

    autopp's stage modules are pruned copies of torchtitan's model, so torchtitan's own
    ``parallelize_llama`` applies. autopp expects gradients averaged over dp (FSDP's
    default), where torchtitan sums them (its loss is pre-divided by the global token count).
    """
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    training = TrainingConfig(
        local_batch_size=args.batch_size // args.dp,
        seq_len=args.seq_len,
        mixed_precision_param="float32",
    )

    def parallelize(stage: torch.nn.Module, sub_mesh) -> torch.nn.Module:
        plain_tensors_across_stages(stage, dims.get_mesh("tp"))
        stage = parallelize_llama(
            stage,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="/tmp",
        )
        for m in stage.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(float(args.dp))
        return stage

    return parallelize


def plain_tensors_across_stages(stage: torch.nn.Module, tp_mesh) -> None:
    """Send this stage's activations as plain tensors (tp-local shards) and re-wrap them.

    With torchtitan's sequence parallelism the activations between stages are DTensors
    sharded on the sequence over tp, on torchtitan's own ParallelDims mesh. autopp's stages
    resolve a received DTensor's mesh from autopp's world mesh, a different DeviceMesh object
    over the same ranks; so here each stage sends its local shard and the next one wraps it
    back (``DTensor.from_local``, Shard(1) on torchtitan's tp mesh).
    """
    from torch.distributed.tensor import DTensor, Shard

    if stage.lm_head is None:  # not the last stage: send the local shard
        stage.register_forward_hook(
            lambda m, args, out: out.to_local() if isinstance(out, DTensor) else out
        )
    if stage.tok_embeddings is None:  # not the first stage: re-wrap what arrives

        def wrap(m, args):
            return tuple(
                DTensor.from_local(a, tp_mesh, [Shard(1)]) if torch.is_tensor(a) else a
                for a in args
            )

        stage.register_forward_pre_hook(wrap)


def mean_cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; torchtitan's loss-parallel CE when logits are vocab-sharded."""
    from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss

    return cross_entropy_loss(pred, labels) / (labels != IGNORE_INDEX).sum()


def run_autopp(args, data: ByteBatches, device: torch.device, *, mode: str) -> dict:
    """mode: "replicate" (parallelize=None), "auto" (the planner), "auto-no-overlap" (the
    planner, stage graphs in traced order), "auto-compile" (the
    planner, stage graphs compiled by Inductor) or "titan" (torchtitan's TP + FSDP as the
    parallelize callable)."""
    from autopp import build_world_mesh, pipeline_autoparallel

    cfg, parallelism = titan_model_config(args)
    parallelize = {"replicate": None, "auto": "auto", "auto-compile": "auto"}.get(mode)
    if mode == "auto-no-overlap":
        from autopp.backends import Planner, PlannerOptions

        parallelize = Planner(PlannerOptions(overlap_collectives=False))
    if mode == "titan":
        dims = titan_parallel_dims(parallelism, dist.get_world_size())
        parallelize = titan_parallelize_fn(args, dims, parallelism)
    mesh = build_world_mesh(pp=args.pp, dp=args.dp, tp=args.tp, device_type=device.type)
    dp_rank = mesh["dp"].get_local_rank()
    inputs, _ = data.get(0, dp_rank, args.dp)
    with torch.device("meta"):
        model = cfg.build()
    pipe = pipeline_autoparallel(
        model,
        mesh,
        example_inputs=(inputs,),
        loss_fn=mean_cross_entropy,
        schedule=args.schedule,
        n_microbatches=args.microbatches,
        parallelize=parallelize,
        **({"compile": True} if mode == "auto-compile" else {}),
    )
    pipe.init_weights(seed=args.seed)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    times, losses = [], []
    for step in range(args.steps):
        inputs, labels = data.get(step, pipe.dp_rank, pipe.dp_size)
        inputs, labels = inputs.to(device), labels.to(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.step(inputs, target=labels)
        pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return {"times": times, "losses": losses}


# ---------------------------------------------------------------- driver


RUNNERS = {
    "torchtitan": run_torchtitan,
    "autopp": functools.partial(run_autopp, mode="replicate"),
    "autopp-auto": functools.partial(run_autopp, mode="auto"),
    "autopp-auto-no-overlap": functools.partial(run_autopp, mode="auto-no-overlap"),
    "autopp-auto-compile": functools.partial(run_autopp, mode="auto-compile"),
    "autopp+titan": functools.partial(run_autopp, mode="titan"),
}


def report(args, results: dict[str, dict]) -> str:
    """Medians (warmup dropped), ratio to torchtitan's median, and loss agreement."""
    base_name = "torchtitan" if "torchtitan" in results else next(iter(results))
    medians = {k: statistics.median(r["times"][args.warmup:]) for k, r in results.items()}
    base = results[base_name]
    lines = [
        f"llama3 {args.model} pp={args.pp} dp={args.dp} tp={args.tp} {args.schedule} "
        f"{args.microbatches} microbatches, batch {args.batch_size} x seq {args.seq_len}, "
        f"{args.device}; median of steps {args.warmup + 1}..{args.steps}",
        f"{'run':14s} {'s/step':>8s} {'/ ' + base_name:>14s}   loss first -> last"
        f"   max |loss - {base_name}|",
    ]
    for name, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        lines.append(
            f"{name:14s} {medians[name]:8.3f} {medians[name] / medians[base_name]:14.2f}   "
            f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}   {diff:.2e}"
        )
    return "\n".join(lines)


def loss_parity(args, results: dict[str, dict]) -> list[str]:
    """Print one verdict line per run against the first run's losses (torchtitan's when it
    ran); the runs whose largest step-wise relative difference ``|l - ref| / |ref|`` exceeds
    ``--max-loss-rel``. Relative: rounding differences scale with the loss, and grow with
    each AdamW step the two runs take from slightly different gradients."""
    base_name = "torchtitan" if "torchtitan" in results else next(iter(results))
    base, failed = results[base_name]["losses"], []
    for name, r in results.items():
        if name == base_name:
            continue
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base))
        ok = rel <= args.max_loss_rel
        failed += [] if ok else [name]
        print(f"loss parity {name} vs {base_name}: {'ok' if ok else 'FAIL'} (max relative "
              f"difference {rel:.2e} over {len(base)} steps, bound {args.max_loss_rel:g})",
              flush=True)
    return failed


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    data = ByteBatches(load_corpus(), args.seq_len, args.batch_size, args.seed)
    results = {}
    for name in args.runs.split(","):
        if name not in RUNNERS:
            raise SystemExit(f"unknown run {name!r}; choose from {sorted(RUNNERS)}")
        results[name] = RUNNERS[name](args, data, device)
        dist.barrier()
    failed = []
    if dist.get_rank() == 0:
        print(report(args, results), flush=True)
        if args.max_loss_rel is not None:
            failed = loss_parity(args, results)
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
