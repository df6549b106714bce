"""Worker for the any-decoder tests: pipelines of qwen3 (tied embeddings) and a Hugging Face
style nested decoder, trained for two AdamW steps (run under tests.harness.launch)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.harness.case import Case, parity_options, pipeline_keywords
from tests.harness.launch import ships_tensors
from tests.harness.parity import norms
from tests.harness.models import MODELS, ce_loss, make_batch
from tests.harness.ranks import dp_rows, fsdp_per_block, full


def two_steps(mesh, cfg: Case, path: str | None = None) -> dict:
    """Step, clip, AdamW step, step again; the first step's gradients by FQN. With ``path``:
    save a checkpoint, load it into a fresh pipeline, and compare eval losses."""
    from autopp import pipeline_autoparallel

    tokens, target = make_batch(cfg.batch, cfg.seq)
    tok, tgt = dp_rows(mesh, tokens, target)

    parallelize = cfg.parallelize
    if cfg.planner_options is not None:
        from autopp.backends import Planner

        options = dict(cfg.planner_options)
        if cfg.bf16:  # bf16 compute, fp32 masters and gradient reductions
            from torch.distributed.fsdp import MixedPrecisionPolicy

            options["mixed_precision"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        parallelize = Planner(parity_options(**options))

    def build(schedule=cfg.schedule):
        return pipeline_autoparallel(
            MODELS[cfg.model](cfg.n_layers), mesh, example_inputs=(tok,),
            loss_fn=ce_loss, schedule=schedule, n_microbatches=cfg.n_microbatches,
            parallelize=parallelize, **pipeline_keywords(cfg))

    pipe = build()
    if cfg.expect_error:
        try:
            pipe.init_weights(seed=0)
        except ValueError as e:
            return {"error": str(e)}
        return {"error": None}
    pipe.init_weights(seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr)
    losses = [pipe.step(tok, target=tgt)]
    grads = {name: full(p.grad).detach().clone() for name, p in pipe.named_parameters()}
    norm = pipe.clip_grad_norm_(cfg.max_norm)
    opt.step()
    opt.zero_grad()
    losses.append(pipe.step(tok, target=tgt))
    ckpt = {}
    if path is not None:
        import torch.distributed.checkpoint as dcp

        pipe.save_checkpoint(path)
        fresh = build()
        fresh.init_weights(seed=1)
        ckpt = {"eval": pipe.eval(tok, target=tgt), "eval_fresh": fresh.eval(tok, target=tgt)}
        fresh.load_checkpoint(path)
        ckpt["eval_loaded"] = fresh.eval(tok, target=tgt)
        ckpt["keys"] = sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        if cfg.cross:  # into the other placement (loop <-> V) and back
            other = build(cfg.cross)
            other.init_weights(seed=2)
            other.load_checkpoint(path)
            ckpt["eval_cross"] = other.eval(tok, target=tgt)
            other.save_checkpoint(path + "-cross")
            ckpt["cross_keys"] = sorted(
                dcp.FileSystemReader(path + "-cross").read_metadata().state_dict_metadata)
            back = build()
            back.init_weights(seed=3)
            back.load_checkpoint(path + "-cross")
            ckpt["eval_back"] = back.eval(tok, target=tgt)
    return {"losses": losses, "checkpoint": ckpt, "norm": norm,
            "grads": grads if ships_tensors(mesh) else {}, "grad_norms": norms(grads),
            "units": {sid: [b.prefix for b in plan.blocks]
                      for sid, plan in (pipe.plans or {}).items()},
            # the planned placement of each parameter ("S(0)", "R", ... per sub-mesh dim:
            # dp, tp) and the ops of the planned blocks, by name
            "placements": {p.fqn: tuple(p.placements) for plan in (pipe.plans or {}).values()
                           for p in plan.params},
            "ops": sorted({name.rstrip("_0123456789") for plan in (pipe.plans or {}).values()
                           for b in plan.blocks for name, _, _ in b.nodes}),
            "notes": list(pipe.layout.model_notes),
            "stage_fqns": {sid: list(pipe.layout.fqns_per_stage[sid]) for sid in pipe.plans or {}},
            "state_keys": sorted(pipe.state_dict()),
            "values": {name: full(p).detach().clone() for name, p in pipe.named_parameters()
                       if "embed" in name or "lm_head" in name}}


def run(rank: int, world_size: int, configs: list[Case], path: str) -> list[dict]:
    from autopp import build_world_mesh

    out = []
    for i, cfg in enumerate(configs):
        mesh = build_world_mesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)
        out.append(two_steps(mesh, cfg, f"{path}/{i}" if cfg.checkpoint else None))
        dist.barrier()
    return out


def mismatched_tied_parallelize(stage: torch.nn.Module, sub_mesh) -> torch.nn.Module:
    """A user ``parallelize`` that places the tied copies differently: the embedding's
    copy split over tp by rows, the head's by columns (init must refuse it on every rank)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, mod in stage.named_modules():
        w = getattr(mod, "weight", None)
        if name.endswith(("tok_embeddings", "output", "lm_head")) and w is not None:
            shard = Shard(0) if name.endswith("tok_embeddings") else Shard(1)
            mod.weight = torch.nn.Parameter(distribute_tensor(
                torch.empty_like(w, device="cpu"), sub_mesh["tp"], [shard]))
    return stage


def fsdp_parallelize(stage: torch.nn.Module, sub_mesh) -> torch.nn.Module:
    """A user parallelize function for transformers decoders: FSDP2 over "dp" per block and
    for the stage root (replicated over "tp")."""
    return fsdp_per_block(stage, stage.model.layers.values(), sub_mesh["dp"])


def hf_checkpoint_round_trip(rank: int, world_size: int, src: str, dst: str, kind: str,
                             layouts: tuple = ((2, 2, 2), (4, 1, 2))) -> dict:
    """Load the ``save_pretrained`` directory ``src`` into a planned pipeline of the first
    (pp, dp, tp) layout, eval, take one AdamW step, save to ``dst`` (with the config), eval;
    then load ``dst`` into the second layout and eval."""
    from autopp import build_world_mesh, pipeline_autoparallel

    tokens, target = make_batch(8, 16)
    out = {}
    for i, (pp, dp, tp) in enumerate(layouts):
        mesh = build_world_mesh(pp=pp, dp=dp, tp=tp)
        tok, tgt = dp_rows(mesh, tokens, target)
        model = MODELS[kind](4)
        pipe = pipeline_autoparallel(model, mesh, example_inputs=(tok,), loss_fn=ce_loss,
                                     schedule="1F1B", n_microbatches=max(pp, 2))
        pipe.init_weights(seed=7)
        if i == 0:
            pipe.load_pretrained(src)
            out["loaded"] = pipe.eval(tok, target=tgt)
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
            pipe.step(tok, target=tgt)
            opt.step()
            pipe.save_pretrained(dst, config=model.config)
            out["trained"] = pipe.eval(tok, target=tgt)
        else:
            pipe.load_pretrained(dst)
            out["reloaded"] = pipe.eval(tok, target=tgt)
        dist.barrier()
    return out


def run_then_round_trip(rank: int, world_size: int, configs: list[Case], path: str,
                        src: str, dst: str, kind: str) -> tuple[list[dict], dict]:
    """:func:`run` and then :func:`hf_checkpoint_round_trip`, in one launch."""
    return (run(rank, world_size, configs, path),
            hf_checkpoint_round_trip(rank, world_size, src, dst, kind))


def padded_batch(batch: int, seq: int, shift: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, targets and a 2-D padding ``attention_mask``: row b has its first
    (3·b + shift) % seq positions padded (left padding: mask 0, target ignored), so rows
    differ in length and the real tokens would attend to the padding without the mask."""
    tokens, target = make_batch(batch, seq)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        pad = (3 * b + shift) % seq
        if pad:
            mask[b, :pad] = 0
            target[b, :pad] = -100
    return tokens, target, mask


def packed_batch(batch: int, seq: int, shift: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Tokens, targets, ``position_ids`` and document lengths of a padding-free packed batch:
    three documents a row, of lengths that differ between rows (and with ``shift``);
    positions restart at each document and each document's last target (the next
    document's first token) is ignored, as are the targets ``make_batch`` ignores."""
    tokens, target = make_batch(batch, seq)
    positions = torch.empty(batch, seq, dtype=torch.long)
    lengths = []
    for b in range(batch):
        first, second = 3 + (b + shift) % 4, 4 + (2 * (b + shift)) % 5
        row = [first, second, seq - first - second]
        start = 0
        for n in row:
            positions[b, start:start + n] = torch.arange(n)
            target[b, start + n - 1] = -100
            start += n
        lengths.append(row)
    return tokens, target, positions, lengths


def hf_tensor_parallel(stage: torch.nn.Module, sub_mesh) -> torch.nn.Module:
    """A user ``parallelize`` for transformers' Llama blocks: torch's Megatron-style tensor
    parallelism over "tp" (q/k/v and gate/up column-wise, o and down row-wise); the rest
    stays replicated."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for block in stage.model.layers.values():
        parallelize_module(block, sub_mesh["tp"], plan)
    return stage


def packed_steps(mesh, cfg: Case) -> dict:
    """A transformers decoder, tensor parallel by a user ``parallelize``, stepped on a
    packed batch: ``position_ids`` go to every stage, whose attention keeps each token in
    its own document."""
    from autopp import pipeline_autoparallel

    tokens, target, positions, _ = packed_batch(cfg.batch, cfg.seq)
    pipe = pipeline_autoparallel(
        MODELS[cfg.model](cfg.n_layers), mesh, example_inputs=(tokens,),
        loss_fn=ce_loss, schedule=cfg.schedule, n_microbatches=cfg.n_microbatches,
        parallelize=hf_tensor_parallel)
    pipe.init_weights(seed=0)
    loss = pipe.step(tokens, target=target, position_ids=positions)
    grads = {name: full(p.grad).detach().clone() for name, p in pipe.named_parameters()}
    return {"loss": loss, "grads": grads,
            "tp_sharded": sorted(n for n, p in pipe.named_parameters()
                                 if isinstance(p, DTensor) and p.placements[-1].is_shard()),
            "eval": pipe.eval(tokens, target=target, position_ids=positions),
            "eval_unpacked": pipe.eval(tokens, target=target)}


def planned_keyword_steps(mesh, cfg: Case, kind: str) -> dict:
    """A transformers decoder planned (``parallelize="auto"``) for a keyword input: a padded
    batch's ``attention_mask`` (``kind="padded"``) or a packed batch's ``position_ids``
    (``"packed"``), stepped twice from the same weights (gradients zeroed between, no
    optimizer) with a different mask or document layout each time, and evaluated: each
    step's loss, eval loss and gradients by FQN. And the refusal of a step without it."""
    from autopp import pipeline_autoparallel

    def batch(shift: int):
        if kind == "padded":
            tokens, target, mask = padded_batch(cfg.batch, cfg.seq, shift)
            return tokens, target, {"attention_mask": mask}
        tokens, target, positions, _ = packed_batch(cfg.batch, cfg.seq, shift)
        return tokens, target, {"position_ids": positions}

    tokens, target, kw = batch(0)
    pipe = pipeline_autoparallel(
        MODELS[cfg.model](cfg.n_layers), mesh, example_inputs=(tokens,),
        example_kwargs=kw, loss_fn=ce_loss, schedule=cfg.schedule,
        n_microbatches=cfg.n_microbatches, parallelize="auto")
    pipe.init_weights(seed=0)
    out: dict = {"steps": []}
    for shift in cfg.shifts:
        tokens, target, kw = batch(shift)
        pipe.zero_grad()
        loss = pipe.step(tokens, target=target, **kw)
        grads = {name: full(p.grad).detach().clone() for name, p in pipe.named_parameters()}
        out["steps"].append({"loss": loss, "grads": grads,
                             "eval": pipe.eval(tokens, target=target, **kw)})
    try:
        pipe.eval(tokens, target=target)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def masked_steps(rank: int, world_size: int, cfg: Case) -> dict:
    """One launch of 4 ranks, two meshes: :func:`padded_steps` at pp2 × dp2, then
    :func:`packed_steps` at pp2 × tp2, then the same batches' keyword inputs to planned
    stages at pp2 × tp2 (:func:`planned_keyword_steps`)."""
    from autopp import build_world_mesh

    out = padded_steps(rank, world_size, cfg)
    dist.barrier()
    mesh = build_world_mesh(pp=2, dp=1, tp=2)
    out["packed"] = packed_steps(mesh, cfg)
    dist.barrier()
    for kind in ("padded", "packed"):
        out[f"planned_{kind}"] = planned_keyword_steps(mesh, cfg, kind)
        dist.barrier()
    return out


def padded_steps(rank: int, world_size: int, cfg: Case) -> dict:
    """A transformers decoder replicated on its stages (``parallelize=None``) stepped on a
    padded batch: the mask goes to every stage as a keyword input. And the refusal of a
    planned pipeline given one."""
    from autopp import build_world_mesh, pipeline_autoparallel

    mesh = build_world_mesh(pp=cfg.pp, dp=cfg.dp, tp=1)
    tokens, target, mask = padded_batch(cfg.batch, cfg.seq)
    tok, tgt, msk = dp_rows(mesh, tokens, target, mask)
    pipe = pipeline_autoparallel(
        MODELS[cfg.model](cfg.n_layers), mesh, example_inputs=(tok,), loss_fn=ce_loss,
        schedule=cfg.schedule, n_microbatches=cfg.n_microbatches, parallelize=None)
    pipe.init_weights(seed=0)
    loss = pipe.step(tok, target=tgt, attention_mask=msk)
    grads = {name: full(p.grad).detach().clone() for name, p in pipe.named_parameters()}
    out = {"loss": loss, "grads": grads,
           "eval": pipe.eval(tok, target=tgt, attention_mask=msk),
           "eval_unmasked": pipe.eval(tok, target=tgt)}
    try:
        pipe.step(tok, target=tgt, attention_mask=msk[:1])  # one row, not the batch
    except ValueError as e:
        out["bad_kwarg"] = str(e)
    return out
