"""Worker for the GPT-2-style tests: transformers decoders whose forward reads its input's
shape, pipelined and trained two AdamW steps (run under tests.harness.launch)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.harness.case import Case, parity_options, pipeline_keywords
from tests.harness.launch import ships_tensors
from tests.harness.models import MODELS, ce_loss, make_batch
from tests.harness.parity import norms
from tests.harness.ranks import dp_rows, fsdp_per_block, full


def fsdp_blocks(stage: torch.nn.Module, sub_mesh) -> torch.nn.Module:
    """A user ``parallelize`` for GPT-2-style decoders: FSDP2 over "dp" per block
    (``transformer.h``) and for the stage root (replicated over "tp")."""
    return fsdp_per_block(stage, stage.transformer.h.values(), sub_mesh["dp"])


def two_steps(mesh, cfg: Case) -> dict:
    """Step, clip, AdamW step, step again: the losses, the first step's gradients by FQN,
    the planned units and which parameters are split over tp, and the model notes."""
    from autopp import pipeline_autoparallel
    from autopp.backends import Planner

    parallelize = (cfg.parallelize if cfg.planner_options is None
                   else Planner(parity_options(**cfg.planner_options)))
    tokens, target = make_batch(cfg.batch, cfg.seq)
    tok, tgt = dp_rows(mesh, tokens, target)
    pipe = pipeline_autoparallel(
        MODELS[cfg.model](cfg.n_layers), mesh, example_inputs=(tok,), loss_fn=ce_loss,
        schedule=cfg.schedule, n_microbatches=cfg.n_microbatches,
        parallelize=parallelize, **pipeline_keywords(cfg))
    pipe.init_weights(seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr)
    losses = [pipe.step(tok, target=tgt)]
    grads = {name: full(p.grad).detach().clone() for name, p in pipe.named_parameters()}
    norm = pipe.clip_grad_norm_(cfg.max_norm)
    opt.step()
    opt.zero_grad()
    losses.append(pipe.step(tok, target=tgt))
    return {"losses": losses, "norm": norm,
            "grads": grads if ships_tensors(mesh) else {}, "grad_norms": norms(grads),
            "units": {sid: [b.prefix for b in plan.blocks]
                      for sid, plan in (pipe.plans or {}).items()},
            "tp_sharded": sorted(n for n, p in pipe.named_parameters()
                                 if isinstance(p, DTensor) and p.placements[-1].is_shard()),
            "model_notes": list(pipe.layout.model_notes)}


def run(rank: int, world_size: int, configs: list[Case]) -> list[dict]:
    from autopp import build_world_mesh

    out = []
    for cfg in configs:
        mesh = build_world_mesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)
        out.append(two_steps(mesh, cfg))
        dist.barrier()
    return out
