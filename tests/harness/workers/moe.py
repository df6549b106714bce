"""Worker for the mixture-of-experts tests: torchtitan's MoE decoders through the planner on
8 gloo ranks (run under tests.harness.launch)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.distributed as dist

from tests.harness.case import Case, parity_options, vary
from tests.harness.launch import ships_tensors
from tests.harness.parity import norms
from tests.harness.models import MODELS, ce_loss, make_batch
from tests.harness.ranks import dp_rows, full


@contextlib.contextmanager
def fp32_experts():
    """torchtitan's GroupedExperts with its matmuls in the parameters' dtype (the reference's
    own SwiGLU grouped matmul; torchtitan's casts to bf16)."""
    from torchtitan.models.common.moe import GroupedExperts

    def forward(self, x, num_tokens_per_expert):
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1_EFD.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3_EFD.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offs)

    original = GroupedExperts.forward
    GroupedExperts.forward = forward
    try:
        yield
    finally:
        GroupedExperts.forward = original


def _full(t: torch.Tensor) -> torch.Tensor:
    return full(t).detach().clone()


def _dp_slice(mesh, batch: int, seq: int, seed: int):
    return dp_rows(mesh, *make_batch(batch, seq, seed=seed))


def _build(cfg: Case, mesh, tok):
    """The pipeline of ``cfg``; planned, with the MoE planner options ``cfg`` asks for
    (token dispatch, experts in fp32 or bf16)."""
    from autopp import pipeline_autoparallel
    from autopp.backends import Planner, PlannerOptions

    parallelize = cfg.parallelize
    if parallelize == "auto":
        parallelize = Planner(options=parity_options(
            mixed_precision=_policy(cfg), token_dispatch=cfg.dispatch,
            expert_dims=cfg.expert_dims, expert_compute_dtype="param" if cfg.fp32_experts else "bfloat16"))
    return pipeline_autoparallel(
        MODELS[cfg.model](cfg.n_layers), mesh, example_inputs=(tok,), loss_fn=ce_loss,
        schedule=cfg.schedule, n_microbatches=cfg.n_microbatches,
        parallelize=parallelize,
        options=None if not isinstance(parallelize, str) else PlannerOptions(
            mixed_precision=_policy(cfg)))


def _policy(cfg: Case):
    """bf16 compute with fp32 gradient reductions (torchtitan's training policy) when
    ``cfg.bf16``, else None."""
    if not cfg.bf16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def train(mesh, cfg: Case, path: str | None) -> dict:
    """``cfg.steps`` AdamW steps with clipping (step k on batch seed 100 + k): the first
    step's gradients and expert biases after it, every loss, the plan's expert placements.
    With ``path`` and ``cfg.resume`` (pp, dp, tp): save after the steps, train one more
    step, then a pipeline at the resume layout loads the checkpoint and trains that step."""
    from autopp import build_world_mesh

    tok, tgt = _dp_slice(mesh, cfg.batch, cfg.seq, 100)
    pipe = _build(cfg, mesh, tok)
    pipe.init_weights(seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr)
    out: dict = {"losses": []}
    for step in range(cfg.steps):
        tok, tgt = _dp_slice(mesh, cfg.batch, cfg.seq, 100 + step)
        out["losses"].append(pipe.step(tok, target=tgt))
        if step == 0:
            grads = {n: _full(p.grad) for n, p in pipe.named_parameters()}
            out["grads"] = grads if ships_tensors(mesh) else {}
            out["grad_norms"] = norms(grads)
            out["bias"] = {k: _full(v) for k, v in pipe.state_dict().items()
                           if k.endswith("expert_bias_E")}
        pipe.clip_grad_norm_(cfg.max_norm)
        opt.step()
        opt.zero_grad()
    out["placements"] = sorted({str(b) for plan in (pipe.plans or {}).values()
                                for b in _expert_placements(plan)})
    out["dispatch"] = sorted({_dispatch_of(ins) for plan in (pipe.plans or {}).values()
                              for b in plan.blocks for name, _, ins in b.nodes
                              if name.startswith("routed_experts")})
    out["stage_dispatch"] = {  # per planned stage: its modules, its routed-experts ops' kinds
        sid: (list(pipe.layout.fqns_per_stage[sid]),
              sorted({_dispatch_of(ins) for b in plan.blocks for name, _, ins in b.nodes
                      if name.startswith("routed_experts")}))
        for sid, plan in (pipe.plans or {}).items()}
    if path is not None and cfg.resume:
        pipe.save_checkpoint(path, opt)
        tok, tgt = _dp_slice(mesh, cfg.batch, cfg.seq, 100 + cfg.steps)
        out["next"] = pipe.step(tok, target=tgt)
        pp, dp, tp = cfg.resume
        mesh2 = build_world_mesh(pp=pp, dp=dp, tp=tp)
        tok2, tgt2 = _dp_slice(mesh2, cfg.batch, cfg.seq, 100 + cfg.steps)
        other = _build(vary(cfg, schedule="1F1B", n_microbatches=pp), mesh2, tok2)
        other.init_weights(seed=1)
        opt2 = torch.optim.AdamW(other.parameters(), lr=cfg.lr)
        other.load_checkpoint(path, opt2)
        out["resumed"] = other.step(tok2, target=tgt2)
    return out


def _expert_placements(plan) -> list[tuple[str, ...]]:
    """The planned placements of routed-expert weights in a stage plan."""
    return [tuple(pl) for fqn, pl in plan.param_placements().items() if "_EFD" in fqn]


def _dispatch_of(ins) -> str:
    """How a planned routed-experts node gets tokens to its experts: "all_to_all (dims)"
    (tokens and experts split over those sub-mesh dims: 0 dp, 1 tp), "all_gather" (experts
    split, tokens whole), or "local" (experts not split)."""
    bwd = len(ins) == 10  # the backward: (grad, x, scores, ids, expert_ids, w1-3, routing)
    x, expert_ids = ins[1 if bwd else 0], ins[4 if bwd else 3]
    split = [e.startswith("S") for e in expert_ids]
    dims = tuple(d for d, (s, t) in enumerate(zip(split, x)) if s and t.startswith("S"))
    if dims:
        return f"all_to_all {dims}"
    return "all_gather" if any(split) else "local"


def run(rank: int, world_size: int, configs: list[Case], path: str) -> list[dict]:
    from autopp import build_world_mesh

    out = []
    for i, cfg in enumerate(configs):
        mesh = build_world_mesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)
        # stages that run the model's modules as written (parallelize=None) compute its
        # experts in fp32 as the reference does
        as_written = cfg.parallelize is None and cfg.fp32_experts
        with fp32_experts() if as_written else contextlib.nullcontext():
            out.append(train(mesh, cfg, f"{path}/{i}"))
        dist.barrier()
    return out
