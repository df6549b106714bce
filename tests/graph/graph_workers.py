"""Workers of the graph-stage launches (run under tests.harness.launch): graph stages on torch's
runtime schedules, with and without recomputation, against one process."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch
import torch.fx as fx
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from graph_models import build_llama, lm_loss, mse_loss, prune  # noqa: E402

from autopp.graph import (  # noqa: E402
    GraphStage,
    attach_graph_runtime,
    build_stage_graphs,
    compile_stage_graphs,
)
from tests.harness.parity import assert_loss_parity, assert_parity  # noqa: E402

N_STAGES, N_MB, MB, SEQ = 4, 4, 1, 16


def _stage_ids(rank: int, world: int, style: str) -> list[int]:
    if style == "v":
        return [rank, N_STAGES - 1 - rank]
    return list(range(rank, N_STAGES, world))


def _reference(model: nn.Module, inputs, target, loss_fn):
    model.zero_grad(set_to_none=True)
    losses = []
    for x, t in zip(inputs.chunk(N_MB), target.chunk(N_MB)):
        loss = loss_fn(model(x), t) / N_MB
        loss.backward()
        losses.append(loss.detach() * N_MB)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, torch.stack(losses)


def _run_schedule(cls, stages_by_id, graphs_by_id, inputs, target, loss_fn, rank, world):
    stages = []
    for sid, mod in stages_by_id.items():
        mod.zero_grad(set_to_none=True)
        stages.append(GraphStage(mod, graphs_by_id[sid], stage_index=sid,
                                 num_stages=N_STAGES, device="cpu"))
    schedule = cls(stages, n_microbatches=N_MB, loss_fn=loss_fn)
    runtime = attach_graph_runtime(schedule)
    losses: list[torch.Tensor] = []
    runtime.step(inputs, target=target, losses=losses)
    return losses


def _compare(name, stages_by_id, ref_grads, losses, ref_losses, stage_ids):
    n = 0
    for mod in stages_by_id.values():
        for fqn, p in mod.named_parameters():
            if p.grad is None:
                raise AssertionError(f"{name}: no grad for {fqn}")
            assert_parity(p.grad, ref_grads[fqn], what=f"{name} {fqn}")
            n += 1
    if N_STAGES - 1 in stage_ids:
        for i, (got, ref) in enumerate(zip(losses, ref_losses)):
            assert_loss_parity(float(got), float(ref), what=f"{name} microbatch {i}")
    return n


def _llama_case(rank, world):
    model = build_llama(n_layers=N_STAGES)
    torch.manual_seed(123)
    tokens = torch.randint(0, 2048, (N_MB * MB, SEQ))
    target = torch.randint(0, 2048, (N_MB * MB, SEQ))
    ref_grads, ref_losses = _reference(model, tokens, target, lm_loss)

    def stage_module(sid):
        return prune(model, [str(sid)], first=sid == 0, last=sid == N_STAGES - 1)

    def graphs(sid, mod):
        x = tokens[:MB] if sid == 0 else torch.randn(MB, SEQ, 256)
        last = sid == N_STAGES - 1
        return build_stage_graphs(mod, (x,), loss_fn=lm_loss if last else None,
                                  target=target[:MB] if last else None)
    return model, tokens, target, ref_grads, ref_losses, stage_module, graphs


class _Mlp(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run(rank: int, world: int) -> list[str]:
    """Each schedule's line of this rank's report (under tests.harness.launch)."""
    from torch.distributed.pipelining import (
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )

    import copy
    import time

    report = []
    t0 = time.time()
    _, tokens, target, ref_grads, ref_losses, stage_module, graphs = _llama_case(rank, world)
    for cls, style in ((ScheduleInterleaved1F1B, "loop"), (ScheduleLoopedBFS, "loop"),
                       (ScheduleInterleavedZeroBubble, "loop"),
                       (ScheduleZBVZeroBubble, "v"), (ScheduleDualPipeV, "v")):
        ids = _stage_ids(rank, world, style)
        mods = {sid: stage_module(sid) for sid in ids}
        gs = {sid: graphs(sid, mods[sid]) for sid in ids}
        losses = _run_schedule(cls, mods, gs, tokens, target, lm_loss, rank, world)
        n = _compare(cls.__name__, mods, ref_grads, losses, ref_losses, ids)
        report.append(f"{cls.__name__} eager llama: {n} grads ok ({time.time() - t0:.1f}s)")

    # Inductor-compiled graph stages on the zero-bubble and V schedules (small MLP: a
    # cold compile of a llama stage costs ~90 s here; identical graphs hit Inductor's cache)
    torch.manual_seed(7)
    mlp = _Mlp(N_STAGES)
    x, y = torch.randn(N_MB * 2, 16), torch.randn(N_MB * 2, 16)
    ref_grads, ref_losses = _reference(mlp, x, y, mse_loss)
    import copy
    for cls, style in ((ScheduleInterleavedZeroBubble, "loop"),
                       (ScheduleZBVZeroBubble, "v"), (ScheduleDualPipeV, "v")):
        ids = _stage_ids(rank, world, style)
        mods = {}
        for sid in ids:
            m = copy.deepcopy(mlp)
            m.layers = nn.ModuleList(
                [l if i == sid else nn.Identity() for i, l in enumerate(m.layers)])
            mods[sid] = m
        gs = {sid: compile_stage_graphs(build_stage_graphs(
                  mods[sid], (x[:2],), loss_fn=mse_loss if sid == N_STAGES - 1 else None,
                  target=y[:2] if sid == N_STAGES - 1 else None)) for sid in ids}
        losses = _run_schedule(cls, mods, gs, x, y, mse_loss, rank, world)
        assert all(g.runners for g in gs.values())
        n = _compare(f"{cls.__name__} compiled", mods, ref_grads, losses, ref_losses, ids)
        report.append(f"{cls.__name__} inductor mlp: {n} grads ok ({time.time() - t0:.1f}s)")
    return report


def recomputed(gm: fx.GraphModule | None) -> set[str]:
    """Names of the forward nodes ``gm`` recomputes (not those it receives recomputed)."""
    if gm is None:
        return set()
    return {n.meta["recomputed_from"] for n in gm.graph.nodes
            if n.op == "call_function" and "recomputed_from" in n.meta}


def zbv_recompute(rank: int, world: int) -> list[str]:
    """llama3 debugmodel, 4 stages in a V on 2 ranks, ZBVZeroBubble (I and W apart), with
    recomputing graph stages, against one process."""
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    report = []
    _, tokens, target, ref_grads, ref_losses, stage_module, _ = _llama_case(rank, world)
    ids = _stage_ids(rank, world, "v")
    for rc in ("full", "selective"):
        mods = {sid: stage_module(sid) for sid in ids}
        graphs = {}
        for sid in ids:
            last = sid == N_STAGES - 1
            x = tokens[:MB] if sid == 0 else torch.randn(MB, SEQ, 256)
            graphs[sid] = build_stage_graphs(
                mods[sid], (x,), loss_fn=lm_loss if last else None,
                target=target[:MB] if last else None, recompute=rc)
            assert recomputed(graphs[sid].full_backward_graph)
        losses = _run_schedule(ScheduleZBVZeroBubble, mods, graphs, tokens, target,
                               lm_loss, rank, world)
        n = _compare(f"ZBV {rc}", mods, ref_grads, losses, ref_losses, ids)
        report.append(f"ZBVZeroBubble recompute={rc}: {n} grads ok")
    return report
