"""One rank of the gloo apply test (run by ``tests.harness.launch.run_on_ranks``): plan (rank
0), broadcast, apply, compare with reference."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh


class BlockStack(nn.Module):
    """A middle pipeline stage: llama3 blocks only."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleDict(layers)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x, None, None)
        return x


def build(device: str, kind: str = "stack") -> nn.Module:
    """Two llama3 debugmodel blocks ("stack"), or the whole 2-layer decoder ("decoder":
    embedding, blocks, norm, lm_head: a first-and-last stage), seeded identically."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs["debugmodel"], "sdpa")
    with torch.device("meta"):
        model = cfg.build()
    for k in list(model.layers.keys())[2:]:
        del model.layers[k]
    stage = model if kind == "decoder" else BlockStack(dict(model.layers.items()))
    if device == "meta":
        return stage
    stage.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0, 0.05)
        for layer in stage.layers.values():  # the rope cache, as the model computes it
            layer.attention.rope._init_self_buffers()
    return stage


def run_eager(sharded, plan, mesh, x, w) -> torch.Tensor:
    """Output (full) of the stage run by the DTensor interpreter; backward of (out * w).sum()
    leaves DTensor gradients in the parameters."""
    out = sharded(x).full_tensor()
    (out * w).sum().backward()
    return out.detach()


def run_graphs(sharded, plan, mesh, x, w) -> torch.Tensor:
    """The same through the stage's split graphs (unshard, forward, full backward,
    reduce-grad) on local shards, as the pipeline runtime calls them."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from autopp._compat import graph as _compat
    from autopp.sharding.plan import from_strs

    local, g = sharded.stage_graphs()
    in_pl, out_pl = from_strs(plan.input_placements), from_strs(plan.output_placements)
    params = list(sharded.parameters())
    unsharded = g.unshard_params([p.to_local() for p in params])
    outs, saved = g.forward_flat(unsharded, [b.to_local() for b in sharded.buffers()],
                                 [distribute_tensor(x, mesh, in_pl).to_local()])
    out = DTensor.from_local(outs[0], mesh, out_pl, run_check=False, shape=w.shape,
                             stride=w.stride()).full_tensor()
    _, unreduced = g.full_backward(None, saved, (distribute_tensor(w, mesh, out_pl).to_local(),))
    for p, grad in zip(params, g.reduce_grads(unreduced)):
        grad = _compat.like_param(grad, p)
        p.grad = grad if p.grad is None else p.grad + grad
    return out


def apply_and_compare(rank: int, world: int, dp: int, tp: int) -> dict | None:
    """Each configuration planned, applied and run here against the single-process module;
    rank 0 returns the report (through JSON, as the test reads it), the others None."""
    from autopp.sharding import StagePlan, plan_stage
    from tests.harness.stage_request import stage_request
    from autopp.lower.apply import apply_plan
    from autopp.adapters.torchtitan_reference import torchtitan_param_placements

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    meta_stack = build("meta")
    tt = torchtitan_param_placements(meta_stack, ("dp", "tp"))
    total = sum(p.numel() * p.element_size() for p in meta_stack.parameters())
    hidden = ((4, 16, 256), torch.float32)
    tokens = ((4, 16), torch.long)
    configs = {
        # parameter memory forces sharding over all 4 ranks: FSDP/TP-style placements
        "planned_budget": ("stack", hidden, dict(memory_budget_bytes=total / 4,
                                                 output_placements=None)),
        # torchtitan's FSDP+TP layout, boundaries free (sequence parallel allowed)
        "torchtitan_layout": ("stack", hidden, dict(param_placements=tt, input_placements=None,
                                                    output_placements=None)),
        # sequence-parallel block boundaries: activations sharded on the sequence dim over tp
        "sequence_parallel": ("stack", hidden, dict(param_placements=tt,
                                                    input_placements=("S(0)", "S(1)"),
                                                    output_placements=("S(0)", "S(1)"))),
        # a first-and-last stage: tokens in, logits out, embedding and head planned too
        "decoder": ("decoder", tokens, dict()),
        # the same, run by the reference DTensor interpreter instead of the lowered graphs
        "decoder_dtensor": ("decoder", tokens, dict(), "dtensor"),
    }
    report = {}
    for name, (kind, (shape, dtype), kwargs, *executor) in configs.items():
        x_meta = torch.empty(shape, dtype=dtype, device="meta")
        text = [None]
        if rank == 0:
            plan = plan_stage(stage_request(build("meta", kind), (x_meta,), mesh, profile="H100",
                                            **kwargs))
            text = [plan.to_json()]
        dist.broadcast_object_list(text, src=0)
        plan = StagePlan.from_json(text[0])

        ref = build("cpu", kind)
        torch.manual_seed(1)
        x = torch.randn(shape) if dtype.is_floating_point else torch.randint(0, 2048, shape)
        sharded = apply_plan(ref, plan, mesh, (x_meta,))
        # "graph": the lowered, split stage graphs a pipeline runs; "dtensor": the
        # reference interpreter under autograd
        run = run_graphs if (executor or ["graph"])[0] == "graph" else run_eager
        w = torch.randn(ref(x).shape)
        out = run(sharded, plan, mesh, x, w)
        ref_out = ref(x)
        (ref_out * w).sum().backward()
        def rel_err(a, b):  # max |a - b|, relative to the reference's magnitude when above 1
            return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()

        errs = {"out": rel_err(out, ref_out)}
        ref_params = dict(ref.named_parameters())
        for fqn, p in sharded.named_planned_parameters():
            assert tuple(p.placements) == plan.param_placements()[fqn]
            errs[fqn] = rel_err(p.grad.full_tensor(), ref_params[fqn].grad)
        # a few AdamW steps track the single-process losses
        losses = []
        opt = torch.optim.AdamW([p for _, p in sharded.named_planned_parameters()], lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(3):
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = (run(sharded, plan, mesh, x, w / w.numel()) * w).sum() / w.numel()
            ref_loss = (ref(x) * w).sum() / w.numel()
            ref_loss.backward()
            losses.append((loss.item(), ref_loss.item()))
        report[name] = {
            "losses": losses,
            "errs": errs,
            "num_params": len(ref_params),
            "placements": {p.fqn: p.placements for p in plan.params},
            "blocks": [(b.input_placements, b.output_placements) for b in plan.blocks],
        }
    return json.loads(json.dumps(report)) if rank == 0 else None
