"""Worker functions for the multi-process pipeline tests (run under tests.harness.launch)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness.case import Case, parity_options, pipeline_keywords
from tests.harness.launch import ships_tensors
from tests.harness.parity import norms
from tests.harness.models import ce_loss, llama3_meta, make_batch, sum_loss
from tests.harness.ranks import dp_rows, fsdp_per_block, full, local


#: ``clip=True`` configs clip to this global norm (the test model's gradient norm is ~3).
CLIP_NORM = 0.5


def one_step(mesh, cfg: Case) -> dict:
    """Build a pipeline for ``cfg``, run one step, return its loss and full gradients."""
    from autopp import pipeline_autoparallel

    tokens, target = make_batch(cfg.batch, cfg.seq, seed=cfg.data_seed)
    tok, tgt = dp_rows(mesh, tokens, target)
    from autopp import cross_entropy

    planner = {}
    if cfg.loss_parallel:
        planner["loss_parallel"] = True
    if cfg.bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        planner["mixed_precision"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra = pipeline_keywords(cfg, **planner)
    parallelize = cfg.parallelize
    if cfg.planner_options is not None:  # a backend object instead of the shorthands
        from autopp.backends import Planner

        parallelize = Planner(parity_options(**cfg.planner_options))
    if cfg.count_planning:  # a saved PipelinePlan (or None): count what this rank plans
        import autopp.plan.make as auto_plan

        planners = {f: getattr(auto_plan, f) for f in ("plan_whole_pipeline", "plan_local_stage")}
        calls: dict[str, int] = dict.fromkeys(planners, 0)

        def counted(name):
            def call(*a, **k):
                calls[name] += 1
                return planners[name](*a, **k)
            return call

        for f in planners:
            setattr(auto_plan, f, counted(f))
        extra["plan"] = cfg.plan
    pipe = pipeline_autoparallel(
        llama3_meta(cfg.n_layers),
        mesh,
        example_inputs=(tok,),
        loss_fn=cross_entropy if cfg.loss_parallel else ce_loss,
        schedule=cfg.schedule,
        n_microbatches=cfg.n_microbatches,
        split=cfg.split,
        parallelize=parallelize,
        **extra,
    )
    pipe.init_weights(seed=0)
    counter = pipe.count_collectives() if cfg.count_collectives else None
    loss = pipe.step(tok, target=tgt)
    grads = {n: full(p.grad).detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
    ships = ships_tensors(mesh)
    out = {"loss": loss, "grads": grads if ships else {}, "grad_norms": norms(grads),
           "stage_ids": pipe.layout.stage_ids,
           "describe": pipe.describe(),
           "param_dtypes": sorted({str(p.dtype) for p in pipe.parameters()}),
           "grad_dtypes": sorted({str(p.grad.dtype) for p in pipe.parameters()
                                  if p.grad is not None}),
           # planned stages: weight-gradient graphs the schedule ran as deferred W actions
           "deferred_w": pipe.action_counts.get("W", 0),
           "action_log": pipe.action_log,
           "actions": pipe.action_counts}
    if counter is not None:
        from autopp.lower.local_graphs import collective_counts

        out["collectives"] = counter.summary()
        out["unshard_gathers"] = sum(
            collective_counts(m.stage_graphs()[1].unshard_graph).get("all_gather_into_tensor", 0)
            for m in pipe.stage_modules)
        out["gathered_bytes"] = sum(m.gathered_param_bytes() for m in pipe.stage_modules)
        if (cfg.planner_options or {}).get("weight_gathering") == "per_block":
            from autopp.graph.per_block import (KIND_META, block_collectives,
                                                blocks_in_flight)
            from autopp.graph.overlap import is_wait
            from autopp.graph.walk import closure

            def param_gathers(gm) -> int:  # the inlined gathers of a shard (or its view)
                return sum(1 for n in gm.graph.nodes if n.meta.get(KIND_META) == "gather"
                           and not any(map(is_wait, closure(n.all_input_nodes))))

            graphs = [m.per_block_graphs(cfg.planner_options.get("prefetch_blocks", 1))
                      for m in pipe.stage_modules]
            out["per_block"] = [dict(
                blocks=len(m.blocks),
                counts={k: collective_counts(gm) for k, gm in g.graphs().items()},
                param_gathers={k: param_gathers(gm) for k, gm in g.graphs().items()},
                inlined_reductions={k: block_collectives(gm, "reduce")
                                    for k, gm in g.graphs().items()},
                in_flight={k: blocks_in_flight(gm) for k, gm in g.graphs().items()},
                reductions=collective_counts(m.stage_graphs()[1].reduce_grad_graph)
                if m.stage_graphs()[1].reduce_grad_graph is not None else {})
                for m, g in zip(pipe.stage_modules, graphs)]
    if cfg.saved_bytes:  # planned stages: what each keeps per microbatch, as run and
        from autopp.lower.memory import saved_bytes  # without recomputation

        out["recompute"] = [m.stage_graphs()[1].convention.recompute for m in pipe.stage_modules]
        out["saved_bytes"] = [m.saved_bytes_per_microbatch() for m in pipe.stage_modules]
        out["saved_bytes_none"] = [saved_bytes(m.stage_graphs("none")[1])
                                   for m in pipe.stage_modules]
    if cfg.count_planning:
        for f, fn in planners.items():
            setattr(auto_plan, f, fn)
        out["plan_source"], out["planning_calls"] = pipe.backend.plan_source, calls
        out["pipeline_plan"] = pipe.backend.pipeline_plan.to_json()
    if cfg.eval:
        out["eval_loss"] = pipe.eval(tok, target=tgt)
    if cfg.clip:  # a bound the step's gradient norm exceeds: the gradients shrink
        out["norm"] = pipe.clip_grad_norm_(CLIP_NORM)
        clipped = {n: full(p.grad).detach().clone()
                   for n, p in pipe.named_parameters() if p.grad is not None}
        out["clipped_grads"] = clipped if ships else {}
    return out


def run_configs(rank: int, world_size: int, configs: list[Case]) -> list[dict]:
    from autopp import build_world_mesh

    results = []
    for cfg in configs:
        mesh = build_world_mesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)
        results.append(one_step(mesh, cfg))
        dist.barrier()
    return results


def tp_fsdp_parallelize(stage: torch.nn.Module, sub_mesh) -> torch.nn.Module:
    """A manual parallelize function: TP on each block's MLP (colwise w1/w3, rowwise w2)
    over "tp", then FSDP2 over "dp" per block and for the stage root."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_mesh, dp_mesh = sub_mesh["tp"], sub_mesh["dp"]
    for block in stage.layers.values():
        if tp_mesh.size() > 1:
            parallelize_module(
                block.feed_forward,
                tp_mesh,
                {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()},
            )
    if dp_mesh.size() > 1:
        fsdp_per_block(stage, stage.layers.values(), dp_mesh)
    return stage


def _build(layout: Case, cfg: Case, seed: int):
    """A pipeline over a fresh world mesh of ``layout``, initialised with ``seed``; and a
    function giving this rank's dp slice of the batch of a data seed."""
    from autopp import build_world_mesh, pipeline_autoparallel

    mesh = build_world_mesh(pp=layout.pp, dp=layout.dp, tp=layout.tp)

    def batch(data_seed: int):
        return dp_rows(mesh, *make_batch(cfg.batch, cfg.seq, seed=data_seed))

    pipe = pipeline_autoparallel(
        llama3_meta(cfg.n_layers), mesh,
        example_inputs=(batch(0)[0],), loss_fn=ce_loss,
        schedule=layout.schedule, n_microbatches=layout.n_microbatches,
        parallelize=layout.parallelize,
    )
    pipe.init_weights(seed=seed)
    return pipe, batch


def train_and_round_trip(rank: int, world_size: int, cfg: Case) -> dict:
    """A few AdamW steps with clipping (losses returned), then a state_dict round trip into a
    pipeline initialised differently: the reloaded pipeline's weights and eval loss match."""
    pipe, batch = _build(cfg, cfg, seed=0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        tok, tgt = batch(100 + step)
        losses.append(pipe.step(tok, target=tgt))
        pipe.clip_grad_norm_(cfg.max_norm)
        opt.step()
        pipe.zero_grad()
    tok, tgt = batch(999)
    eval_a = pipe.eval(tok, target=tgt)
    sd = {k: v.detach().clone() for k, v in pipe.state_dict().items()}

    other, _ = _build(cfg, cfg, seed=123)
    eval_fresh = other.eval(tok, target=tgt)
    other.load_state_dict(sd)
    eval_b = other.eval(tok, target=tgt)
    mine = dict(pipe.named_parameters())
    same = all(torch.equal(local(p), local(mine[n])) for n, p in other.named_parameters())
    try:
        other.load_state_dict({**sd, "not_a_module.weight": torch.zeros(1)})
        strict_error = None
    except ValueError as e:
        strict_error = str(e)
    return dict(losses=losses, eval_a=eval_a, eval_b=eval_b, eval_fresh=eval_fresh,
                same=same, strict_error=strict_error)


def checkpoint_resume(rank: int, world_size: int, cfg: Case, path: str) -> dict:
    """Train, save a DCP checkpoint (model + AdamW) mid-run, train on; then a fresh pipeline
    in another layout (``cfg.resume``) loads it and trains the same steps."""

    def run(layout: Case, seed: int, first: int, last: int, save_at: int | None, load: bool):
        pipe, batch = _build(layout, cfg, seed=seed)
        opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr)
        if load:
            pipe.load_checkpoint(path, opt)
        losses = {}
        for step in range(first, last):
            if step == save_at:
                pipe.save_checkpoint(path, opt)
            tok, tgt = batch(200 + step)
            losses[step] = pipe.step(tok, target=tgt)
            opt.step()
            pipe.zero_grad()
        return losses

    straight = run(cfg, seed=0, first=0, last=4, save_at=2, load=False)
    dist.barrier()
    resumed = run(cfg.resume, seed=7, first=2, last=4, save_at=None, load=True)
    return {"straight": straight, "resumed": resumed}


def guards(rank: int, world_size: int, cfg: Case, path: str) -> dict:
    """Each guard on real processes: what every rank raised, and that the last good
    checkpoint survives a refused save."""
    import math

    import warnings

    pipe, batch = _build(cfg, cfg, seed=0)
    assert pipe.raise_on_nonfinite  # the default
    tok, tgt = batch(1)
    out: dict = {"good_loss": pipe.step(tok, target=tgt)}
    pipe.zero_grad()
    pipe.save_checkpoint(path)

    def raised(fn) -> str:
        try:
            fn()
        except (ValueError, FloatingPointError) as e:
            return f"{type(e).__name__}: {e}"
        return "nothing raised"

    out["shape"] = raised(lambda: pipe.step(tok[:, : tok.shape[1] // 2], target=tgt))
    with torch.no_grad():  # a diverged model: every parameter of this rank's stages is NaN
        for p in pipe.parameters():
            local(p).fill_(float("nan"))
    out["nan_step"] = raised(lambda: pipe.step(tok, target=tgt))
    pipe.zero_grad()
    pipe.raise_on_nonfinite = False  # the option to warn instead
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["nan_step_warned"] = raised(lambda: pipe.step(tok, target=tgt))
    out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    pipe.raise_on_nonfinite = True
    out["nan_save"] = raised(lambda: pipe.save_checkpoint(path))
    pipe.zero_grad()
    pipe.load_checkpoint(path)  # the good checkpoint is still there
    out["restored_finite"] = all(bool(torch.isfinite(local(p)).all()) for p in pipe.parameters())
    out["restored_loss"] = pipe.eval(tok, target=tgt)
    out["finite"] = math.isfinite(out["restored_loss"])
    return out


def skip_a_collective(rank: int, world_size: int) -> str:
    """A deadlock made on purpose (the harness's test): rank 1 skips the barrier rank 0 waits
    in and goes on with other work (here: sleeping), so neither ever finishes."""
    import time

    import torch.distributed as dist

    if rank == 1:
        print("rank 1: skipping the barrier", flush=True)
        time.sleep(600)
        return "unreachable"
    print("rank 0: entering the barrier", flush=True)
    dist.barrier()
    return "unreachable"


def exit_without_result(rank: int, world_size: int) -> None:
    """Rank 1 dies without reporting (the harness's test)."""
    import os
    import time

    if rank == 1:
        os._exit(3)
    time.sleep(30)


def raise_after_peer_died(rank: int, world_size: int) -> None:
    """Rank 1 dies without reporting; rank 0 then raises, as a peer of a crashed rank does
    (its connection closed), and its error reaches the harness first (the harness's test)."""
    import os
    import time

    if rank == 1:
        os._exit(3)
    time.sleep(0.3)
    raise RuntimeError("Connection closed by peer (rank 1 is gone)")


def segfault_in_a_function(rank: int, world_size: int) -> None:
    """Rank 1 crashes in native code (a null read) inside a named function (the harness's
    test: its log must show where)."""
    import ctypes
    import time

    def read_address_zero():
        ctypes.string_at(0)

    if rank == 1:
        read_address_zero()
    time.sleep(30)


def built_schedules(rank: int, world_size: int, names: list[tuple[str, int]]) -> list:
    """Each schedule of ``names`` ((name or CSV path, microbatches)) built by
    :func:`autopp.schedules.build_schedule` over plain ``PipelineStage`` s of small linear
    stages, one step: per schedule, this rank's stages' gradients and the single-process
    model's, by stage and parameter index."""
    import logging

    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from autopp.schedules import build_schedule, default_n_stages, schedule_info

    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
    dim, out = 4, []
    for name, n_mb in names:
        n_stages = default_n_stages(name, world_size)
        torch.manual_seed(0)
        mods = [nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_stages)]
        x, target = torch.randn(2 * n_mb, dim), torch.randn(2 * n_mb, dim)
        y = x
        for m in mods:
            y = m(y)
        sum_loss(y, target).backward()
        expected = {i: {str(k): p.grad.clone() for k, p in enumerate(m.parameters())}
                    for i, m in enumerate(mods)}
        for m in mods:
            m.zero_grad()
        ids = schedule_info(name).stage_ids_for_rank(rank, world_size, n_stages)
        stages = [PipelineStage(mods[i], i, n_stages, torch.device("cpu")) for i in ids]
        sched = build_schedule(name, stages, n_microbatches=n_mb, loss_fn=sum_loss,
                               scale_grads=False)
        sched.step(*((x,) if 0 in ids else ()), target=target if n_stages - 1 in ids else None)
        got = {i: {str(k): p.grad.clone() for k, p in enumerate(mods[i].parameters())}
               for i in ids}
        out.append((name, {i: (got[i], expected[i]) for i in ids}))
    return out
