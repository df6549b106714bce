"""Pipeline a torchtitan llama3 whose stages are parallelised with SimpleFSDP, through autopp.graph.

Each pipeline stage is wrapped with torchtitan's SimpleFSDP (``data_parallel``, fully
sharded over the stage's "dp" sub-mesh), traced once into a joint forward+backward graph, and
split into forward / backward-input / backward-weight / unshard (parameter all-gathers) /
reduce-grad (gradient reduce-scatters) callables that torch's pipeline schedule runtime runs
as separate actions (UNSHARD, F, I, W, REDUCE_GRAD). Zero-bubble schedules work on these graph
stages, which torch refuses for torch.compile'd stages.

Run (pp=2 x dp=2 on 4 gloo processes, CPU)::

    torchrun --standalone --nproc-per-node 4 examples/simplefsdp_pp.py --check

``--check`` compares every parameter gradient and the loss with a single-process run of
the same model on the same global batch and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autopp.graph import GraphStage, attach_graph_runtime, build_stage_graphs, compile_stage_graphs

SCHEDULES = {  # name -> (torch class name, stages per pp rank, placement style)
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 1, "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "DualPipeV": ("ScheduleDualPipeV", 2, "v"),
}


def build_model(seed: int = 0) -> torch.nn.Module:
    """llama3 debugmodel (6 layers, dim 256), SDPA attention, fp32 weights on CPU."""
    from torchtitan.experiments.graph_trainer.common_utils import build_decoder_config_for_backend
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs["debugmodel"], "sdpa")
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def split_fqns(n_layers: int, n_stages: int) -> list[list[str]]:
    """Layers split evenly; embeddings with the first stage, norm and head with the last."""
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    stages = [[f"layers.{j}" for j in range(a, b)] for a, b in zip(bounds, bounds[1:])]
    stages[0].insert(0, "tok_embeddings")
    stages[-1] += ["norm", "lm_head"]
    return stages


def stage_module(model: torch.nn.Module, fqns: list[str]) -> torch.nn.Module:
    try:  # autopp's own stage builder, when present
        from autopp.stage_split import build_stage_module
    except ImportError:  # pragma: no cover - prune by hand
        import copy

        stage = copy.deepcopy(model)
        keep = {f.split(".", 1)[1] for f in fqns if f.startswith("layers.")}
        for name in list(stage.layers.keys()):
            if name not in keep:
                del stage.layers[name]
        for name in ("tok_embeddings", "norm", "lm_head"):
            if name not in fqns:
                setattr(stage, name, None)
        return stage
    return build_stage_module(model, fqns)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="ZBVZeroBubble")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="Inductor-compile every callable")
    p.add_argument("--check", action="store_true", help="compare with one process; exit 1 if off")
    args = p.parse_args()

    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // args.pp
    mesh = init_device_mesh("cpu", (args.pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cls_name, per_rank, style = SCHEDULES[args.schedule]
    n_stages = args.pp * per_rank
    ids = ([pp_rank, n_stages - 1 - pp_rank] if style == "v"
           else list(range(pp_rank, n_stages, args.pp)))

    model = build_model()
    fqns = split_fqns(len(model.layers), n_stages)
    torch.manual_seed(1234)  # the same global batch everywhere; each dp rank takes its slice
    n_local = args.microbatches * args.microbatch_size
    tokens = torch.randint(0, 2048, (dp * n_local, args.seq))
    target = torch.randint(0, 2048, (dp * n_local, args.seq))
    my_tokens = tokens[dp_rank * n_local : (dp_rank + 1) * n_local]
    my_target = target[dp_rank * n_local : (dp_rank + 1) * n_local]

    # SimpleFSDP sums gradients over dp (reduce-scatter with SUM); scaling each replica's
    # loss by 1/dp makes the gradient the mean over the global batch.
    def dp_loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, tgt) / dp

    stages, modules = [], {}
    mb = args.microbatch_size
    for sid in ids:
        mod = data_parallel(stage_module(model, fqns[sid]), mesh["dp"], mode="fully_shard")
        last = sid == n_stages - 1
        x = my_tokens[:mb] if sid == 0 else torch.zeros(mb, args.seq, 256)
        graphs = build_stage_graphs(mod, (x,), loss_fn=dp_loss_fn if last else None,
                                    target=my_target[:mb] if last else None)
        if args.compile:
            compile_stage_graphs(graphs)
        if rank == 0:
            print(f"stage {sid} callables:", ", ".join(graphs.graphs()))
        modules[sid] = mod
        stages.append(GraphStage(mod, graphs, stage_index=sid, num_stages=n_stages,
                                 group=mesh["pp"].get_group()))

    import torch.distributed.pipelining as pipelining

    schedule = getattr(pipelining, cls_name)(stages, n_microbatches=args.microbatches,
                                             loss_fn=dp_loss_fn)
    runtime = attach_graph_runtime(schedule)
    losses: list[torch.Tensor] = []
    runtime.step(my_tokens, target=my_target, losses=losses)
    if losses:
        print(f"rank {rank} (pp {pp_rank}, dp {dp_rank}) microbatch losses:",
              [round(l.item() * dp, 4) for l in losses])

    ok = True
    if args.check:
        ref = build_model()
        ref_losses = []
        for x, t in zip(tokens.chunk(dp * args.microbatches), target.chunk(dp * args.microbatches)):
            loss = loss_fn(ref(x), t) / (dp * args.microbatches)
            loss.backward()
            ref_losses.append(loss.detach() * dp * args.microbatches)
        ref_grads = {n: q.grad for n, q in ref.named_parameters()}
        worst = 0.0
        for mod in modules.values():
            for name, param in mod.named_parameters():
                fqn = name.replace("parametrizations.", "").replace(".original", "")
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                worst = max(worst, (grad - ref_grads[fqn]).abs().max().item())
        mine = ref_losses[dp_rank * args.microbatches : (dp_rank + 1) * args.microbatches]
        if losses:
            worst = max(worst, max(abs(a.item() * dp - b.item()) for a, b in zip(losses, mine)))
        ok = worst <= 1e-5
        print(f"rank {rank}: max |grad - single-process grad| = {worst:.2e} "
              f"{'OK' if ok else 'MISMATCH'}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
