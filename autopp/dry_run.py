"""Dry run: plan a whole pipeline for pp × dp × tp ranks on one machine, with no devices.

::

    from autopp.dry_run import dry_run
    with torch.device("meta"):
        model = cfg.build()
    report = dry_run(model, pp=4, dp=8, tp=8, schedule="1F1B", n_microbatches=8,
                     global_batch=64, seq_len=2048, profile="H100", compare=True)
    print(report)

It uses the fake process group (:func:`autopp.mesh.init_fake_world`, set up here unless the
caller already did), splits the model with the same rules as
:func:`autopp.pipeline_autoparallel`, finds every stage's input on meta and plans EVERY stage
(not only one rank's) on the stage sub-mesh, through the on-disk plan cache
(:func:`autopp.auto_plan.plan_local_stage`). All stage sub-meshes have the same shape, so
rank 0's sub-mesh stands for all of them.

Pipeline estimate (Alpa's formula): with ``t_s`` the estimated fwd+bwd time of stage ``s`` on
one microbatch and ``M`` microbatches,

    step time = Σ_s t_s + (M − 1) · max_r Σ_{s on rank r} t_s

(with one stage per rank the last term is the slowest stage); ``t_s`` of the last stage
includes the loss. Point-to-point transfers and their overlap are not in it; the bytes are
reported separately. Stage boundaries and the last stage's logits placement (loss parallel or
not) are chosen as :func:`autopp.pipeline_autoparallel` chooses them
(:func:`autopp.auto_plan.plan_pipeline`).
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autopp.api import split_for_schedule
from autopp.auto_plan import (
    BOUNDARIES,
    last_stage_output,
    loss_time_s,
    boundary_bytes,
    describe_loss,
    plan_pipeline,
    stage_input_shapes,
)
from autopp.mesh import build_world_mesh, init_fake_world, stage_sub_mesh
from autopp.plan_cache import cached_plan, plan_key
from autopp.sharding import StagePlan, plan_stage
from autopp.sharding.memory import activation_bytes_per_microbatch
from autopp.sharding.torchtitan_ref import torchtitan_param_placements
from autopp.stage_split import build_stage_module

logger = logging.getLogger(__name__)

#: torchtitan's llama3 TP plan for the modules around the blocks: ``tok_embeddings``
#: RowwiseParallel (an Embedding's weight sharded on the vocabulary, dim 0) and the output
#: projection ColwiseParallel (weight dim 0); ``norm`` is replicated (sequence parallel).
_TT_VOCAB_SHARDED = ("tok_embeddings", "lm_head", "output")

_BOUNDARY_WORDS = {
    "batch": "batch split over dp, whole over tp",
    "batch+seq": "batch split over dp, sequence over tp",
}


@dataclass(frozen=True)
class StageReport:
    """One stage of a dry run."""

    index: int
    pp_rank: int
    modules: str
    """Compact module list, e.g. ``tok_embeddings, layers.0-7``."""
    input_shapes: tuple[tuple[int, ...], ...]
    """dp-global microbatch shapes entering the stage (what the planner sees)."""
    plan: StagePlan
    plan_wall_s: float
    cached: bool
    send_shape: tuple[int, ...] | None
    """Shape of the activation sent to the next stage, local to one device (in the placement
    :attr:`boundary_out`); None for the last stage."""
    send_bytes: int
    """Bytes one device sends to the next stage per microbatch (0 for the last stage)."""
    torchtitan: StagePlan | None = None
    torchtitan_wall_s: float = 0.0
    torchtitan_cached: bool = False
    boundary_out: str = "batch"
    """Placement of what the stage sends (a key of ``autopp.auto_plan.BOUNDARIES``); for the
    last stage, of its logits ("vocab": loss parallel)."""
    loss_s: float = 0.0
    """Last stage: estimated fwd+bwd time of the loss on one microbatch (0 elsewhere)."""
    torchtitan_loss_s: float = 0.0
    activation_bytes: int | None = None
    """Bytes one microbatch keeps on a device between its forward and backward on this stage
    (read off the lowered graphs, :mod:`autopp.sharding.memory`); None if not computed."""

    @property
    def time_s(self) -> float:
        """Estimated fwd+bwd time of one microbatch on one device (the loss included)."""
        return self.plan.step_time_s + self.loss_s


@dataclass(frozen=True)
class DryRunReport:
    """A planned pipeline: per-stage plans and the pipeline's estimates. ``str()`` prints it."""

    pp: int
    dp: int
    tp: int
    schedule: str
    n_microbatches: int
    global_batch: int
    seq_len: int
    profile: str
    memory_budget_bytes: float | None
    stages: tuple[StageReport, ...]
    stage_ids_per_rank: tuple[tuple[int, ...], ...]
    compare: bool = False
    compare_notes: tuple[str, ...] = field(default=())
    mixed_precision: str | None = None
    """The policy, as text (None: full precision)."""

    # ---- pipeline figures -------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def microbatch_rows(self) -> int:
        """Rows of one microbatch on one dp rank."""
        return self.global_batch // self.dp // self.n_microbatches

    def rank_times_s(self, which: str = "planned") -> list[float]:
        t = self._times(which)
        return [sum(t[s] for s in ids) for ids in self.stage_ids_per_rank]

    def _times(self, which: str) -> list[float]:
        if which == "planned":
            return [s.time_s for s in self.stages]
        return [s.torchtitan.step_time_s + s.torchtitan_loss_s  # type: ignore[union-attr]
                for s in self.stages]

    def pipeline_time_s(self, which: str = "planned") -> float:
        """Alpa: Σ_s t_s + (M − 1) · slowest rank's Σ t_s (one microbatch each)."""
        return sum(self._times(which)) + (self.n_microbatches - 1) * max(self.rank_times_s(which))

    @property
    def step_time_s(self) -> float:
        return self.pipeline_time_s("planned")

    @property
    def torchtitan_step_time_s(self) -> float | None:
        return self.pipeline_time_s("torchtitan") if self.compare else None

    @property
    def step_time_ratio(self) -> float | None:
        """planned / torchtitan estimated pipeline step time (below 1: planned is faster)."""
        tt = self.torchtitan_step_time_s
        return None if not tt else self.step_time_s / tt

    def memory_per_device_bytes(self, which: str = "planned") -> int:
        """Parameter bytes per device: max over pipeline ranks of the sum over its stages."""
        plans = [s.plan if which == "planned" else s.torchtitan for s in self.stages]
        b = [p.param_bytes_per_device for p in plans]  # type: ignore[union-attr]
        return max(sum(b[s] for s in ids) for ids in self.stage_ids_per_rank)

    @property
    def p2p_bytes_per_microbatch(self) -> int:
        """Σ over stage boundaries of the bytes one device sends forward per microbatch."""
        return sum(s.send_bytes for s in self.stages)

    @property
    def p2p_bytes_per_step(self) -> int:
        """Activations forward plus their gradients backward, all boundaries, all
        microbatches, per device of a stage: 2 · M · Σ send_bytes."""
        return 2 * self.n_microbatches * self.p2p_bytes_per_microbatch

    @property
    def planning_s(self) -> float:
        return sum(s.plan_wall_s + s.torchtitan_wall_s for s in self.stages)

    def __str__(self) -> str:
        return format_report(self)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def compact_modules(fqns: Sequence[str]) -> str:
    """``["tok_embeddings", "layers.0", ..., "layers.7"]`` -> ``"tok_embeddings, layers.0-7"``."""
    out: list[str] = []
    run: list[int] = []
    prefix = None

    def flush():
        if run:
            out.append(f"{prefix}{run[0]}" if len(run) == 1 else f"{prefix}{run[0]}-{run[-1]}")
            run.clear()

    for f in fqns:
        m = re.fullmatch(r"(.*\.)(\d+)", f)
        if m and m.group(1) == prefix and run and int(m.group(2)) == run[-1] + 1:
            run.append(int(m.group(2)))
            continue
        flush()
        if m:
            prefix, run[:] = m.group(1), [int(m.group(2))]
        else:
            prefix = None
            out.append(f)
    flush()
    return ", ".join(out)


def placement_summary(plan: StagePlan) -> str:
    """Distinct placements by parameter (layer indices folded): ``wqkv S(0)/S(0), ...``."""
    seen: dict[str, set[str]] = defaultdict(set)
    for p in plan.params:
        name = re.sub(r"^layers\.\d+\.", "", p.fqn).removesuffix(".weight")
        name = name.split(".")[-1]
        seen[name].add("/".join(p.placements))
    return ", ".join(f"{n} {'|'.join(sorted(v))}" for n, v in seen.items())


def format_report(r: DryRunReport) -> str:
    dims = "/".join(r.stages[0].plan.mesh_dim_names) if r.stages else "dp/tp"
    lines = [
        f"Dry run: pp={r.pp} x dp={r.dp} x tp={r.tp} ({r.pp * r.dp * r.tp} ranks, fake process "
        f"group), schedule {r.schedule}, {r.n_stages} stages, profile {r.profile}",
        (f"  mixed precision: {r.mixed_precision}\n" if r.mixed_precision else "")
        + f"  global batch {r.global_batch} x seq {r.seq_len}, {r.n_microbatches} microbatches: "
        f"{r.microbatch_rows} row(s) per microbatch per dp rank "
        f"({r.microbatch_rows * r.dp} dp-global, what the planner sees)",
        "  parameter-memory budget per device: "
        + (_bytes(r.memory_budget_bytes) if r.memory_budget_bytes is not None else
           ("torchtitan's per stage (compare)" if r.compare else "none")),
        "",
        f"Stages (time = estimated fwd+bwd of one microbatch on one device; placements per "
        f"{dims}, a|b where layers differ):",
    ]
    for s in r.stages:
        p = s.plan
        lines += [
            f"  stage {s.index} (pp rank {s.pp_rank}): {s.modules}",
            f"    input {' '.join(str(list(x)) for x in s.input_shapes)}; time {_ms(s.time_s)}"
            f" (compute {_ms(p.compute_s)} + comm {_ms(p.comm_s)}"
            + (f" + loss {_ms(s.loss_s)}" if s.loss_s else "")
            + f"); params {_bytes(p.param_bytes_per_device)}/device",
            f"    placements: {placement_summary(p)}",
            *([f"    kept for the backward: {_bytes(s.activation_bytes)}/device per microbatch "
               "in flight (activations and gathered parameters, from the lowered graphs)"]
              if s.activation_bytes is not None else []),
            f"    sends {list(s.send_shape)} = {_bytes(s.send_bytes)} per microbatch to stage "
            f"{s.index + 1} ({_BOUNDARY_WORDS[s.boundary_out]})" if s.send_shape is not None
            else f"    last stage: {describe_loss(s.boundary_out)}",
            f"    planned in {s.plan_wall_s:.1f} s ({'cached' if s.cached else 'solved'})",
        ]
        if s.torchtitan is not None:
            t = s.torchtitan
            lines.append(
                f"    torchtitan FSDP+TP: time {_ms(t.step_time_s + s.torchtitan_loss_s)} (compute "
                f"{_ms(t.compute_s)} + comm {_ms(t.comm_s)}), params "
                f"{_bytes(t.param_bytes_per_device)}/device; planned/torchtitan "
                f"{s.time_s / (t.step_time_s + s.torchtitan_loss_s):.3f}; priced in {s.torchtitan_wall_s:.1f} s "
                f"({'cached' if s.torchtitan_cached else 'solved'})"
            )
    rank_t = r.rank_times_s()
    slow = max(range(r.pp), key=lambda i: rank_t[i])
    lines += [
        "",
        "Pipeline (Alpa's formula: step = Σ_stages t + (M − 1) × slowest pp rank's Σ t):",
        f"  estimated step time: {_ms(r.step_time_s)} = {_ms(sum(r._times('planned')))} + "
        f"{r.n_microbatches - 1} × {_ms(rank_t[slow])} (pp rank {slow}, stages "
        f"{list(r.stage_ids_per_rank[slow])}); p2p transfers not included",
        f"  parameter memory per device: {_bytes(r.memory_per_device_bytes())} (max over pp "
        f"ranks of the sum over their stages; activations and optimizer state not included)",
        f"  point-to-point per step, all stage boundaries, one device per boundary: "
        f"{_bytes(r.p2p_bytes_per_step)} (2 × {r.n_microbatches} microbatches × "
        f"{_bytes(r.p2p_bytes_per_microbatch)} summed over boundaries: activations forward + "
        "gradients backward)",
        "  planning: " + ", ".join(
            f"stage {s.index} {s.plan_wall_s:.1f} s {'cached' if s.cached else 'solved'}"
            for s in r.stages
        ),
    ]
    if r.compare:
        tt = r.torchtitan_step_time_s
        lines += [
            "",
            "Against torchtitan's manual FSDP+TP layout under the same cost model:",
            f"  torchtitan estimated step time {_ms(tt)}, parameter memory "
            f"{_bytes(r.memory_per_device_bytes('torchtitan'))}/device",
            f"  planned / torchtitan step time: {r.step_time_ratio:.3f}",
        ]
        lines += [f"  note: {n}" for n in r.compare_notes]
    return "\n".join(lines)


def _torchtitan_placements(stage: nn.Module, names: tuple[str, ...]) -> dict:
    """torchtitan's FSDP+TP placements for a llama3 stage, embedding and head included."""
    out = torchtitan_param_placements(stage, names)
    for fqn in out:
        if fqn.split(".")[0] in _TT_VOCAB_SHARDED:
            out[fqn] = tuple(
                Shard(0) if n in ("dp", "tp") else Replicate() for n in names
            )
    return out


def _plan_torchtitan(stage, inputs, sub_mesh, profile, index, *, first: bool, last: bool,
                     mixed_precision=None, n_microbatches: int = 1):
    """torchtitan's layout priced by the planner (activations re-optimised), cached on disk.

    As torchtitan runs it with TP: sequence parallel between blocks, so a stage sends its
    activation split on the sequence over tp ("batch+seq"), and loss parallel (the logits
    stay split on the vocabulary, "vocab") at the end; under PP its FSDP reduces gradients
    once per step, like autopp's planned stages (priced at 1/M per microbatch).
    """
    names = tuple(sub_mesh.mesh_dim_names)
    tp = sub_mesh["tp"].size()
    b_in = "batch" if first or tp == 1 else "batch+seq"
    b_out = ("vocab" if last else "batch+seq") if tp > 1 else "batch"
    options = dict(profile=profile, reference="torchtitan FSDP+TP, vocab-sharded embed/head",
                   boundary_in=b_in, boundary_out=b_out)
    if mixed_precision is not None:
        options["mixed_precision"] = mixed_precision
    options["microbatches_per_grad_reduce"] = n_microbatches
    key = plan_key(stage, inputs, tuple(sub_mesh.shape), names, options)
    t0 = time.perf_counter()
    plan, hit = cached_plan(key, lambda: plan_stage(
        stage, inputs, sub_mesh, profile=profile,
        param_placements=_torchtitan_placements(stage, names),
        input_placements=BOUNDARIES[b_in], output_placements=BOUNDARIES[b_out],
        mixed_precision=mixed_precision, microbatches_per_grad_reduce=n_microbatches,
    ))
    dt = time.perf_counter() - t0
    logger.info("stage %d: torchtitan layout priced in %.1f s (%s)", index, dt,
                "cached" if hit else "solved")
    return plan, dt, hit


def dry_run(
    model_meta: nn.Module,
    *,
    pp: int,
    dp: int,
    tp: int,
    schedule: str = "1F1B",
    n_microbatches: int,
    global_batch: int,
    seq_len: int,
    profile: str = "H100",
    memory_budget_bytes: float | None = None,
    split=None,
    compare: bool = False,
    boundary: str = "auto",
    loss_parallel: bool | None = None,
    mixed_precision=None,
    activations: bool = True,
) -> DryRunReport:
    """Plan the pipeline of ``model_meta`` for a pp × dp × tp world on this machine alone.

    Args:
        model_meta: the whole model on the meta device (e.g. torchtitan's llama3); its first
            input is a ``(batch, seq_len)`` int64 token tensor.
        pp, dp, tp: the world mesh. If torch.distributed is not initialised, the fake process
            group is set up here with pp·dp·tp ranks (and torn down afterwards); otherwise its
            world size must be pp·dp·tp.
        schedule, n_microbatches, split: as for :func:`autopp.pipeline_autoparallel`.
        global_batch, seq_len: the step's batch (all dp ranks) and sequence length.
        profile: the device profile of the cost model ("H100", "H200", "A100", "CPU").
        memory_budget_bytes: per-device bound on each stage's parameter bytes. With
            ``compare`` and no budget, each stage is planned under the parameter memory
            torchtitan's layout uses for it (as ``compare_with_torchtitan`` does), so the
            ratio compares layouts of equal memory.
        compare: also price torchtitan's manual FSDP+TP layout of every stage under the same
            cost model, and report planned/torchtitan (torchtitan as it runs with TP:
            sequence-parallel stage boundaries, loss parallel).
        boundary, loss_parallel, mixed_precision: as for
            :func:`autopp.pipeline_autoparallel` (the loss is taken to be
            :func:`autopp.cross_entropy`); torchtitan's layout is priced under the same
            mixed-precision policy.
        activations: also lower every stage's plan to local graphs (on the fake process
            group) and report the bytes a microbatch keeps for its backward.
    """
    world = pp * dp * tp
    created = False
    if not dist.is_initialized():
        init_fake_world(world)
        created = True
    elif dist.get_world_size() != world:
        raise ValueError(
            f"torch.distributed is initialised with {dist.get_world_size()} ranks, but "
            f"pp={pp} x dp={dp} x tp={tp} needs {world}"
        )
    try:
        return _dry_run(model_meta, pp=pp, dp=dp, tp=tp, schedule=schedule,
                        n_microbatches=n_microbatches, global_batch=global_batch,
                        seq_len=seq_len, profile=profile,
                        memory_budget_bytes=memory_budget_bytes, split=split, compare=compare,
                        boundary=boundary, loss_parallel=loss_parallel,
                        mixed_precision=mixed_precision, activations=activations)
    finally:
        if created:
            dist.destroy_process_group()


def _dry_run(model_meta, *, pp, dp, tp, schedule, n_microbatches, global_batch, seq_len,
             profile, memory_budget_bytes, split, compare, boundary,
             loss_parallel, mixed_precision, activations) -> DryRunReport:
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    mesh = build_world_mesh(pp=pp, dp=dp, tp=tp, device_type="cpu")
    sub_mesh = stage_sub_mesh(mesh)

    info, fqns_per_stage = split_for_schedule(
        model_meta, schedule=schedule, split=split, pp=pp, n_microbatches=n_microbatches,
        local_batch_size=global_batch // dp,
    )
    n_stages = len(fqns_per_stage)
    ids_per_rank = tuple(tuple(info.stage_ids_for_rank(r, pp, n_stages)) for r in range(pp))
    rank_of = {s: r for r, ids in enumerate(ids_per_rank) for s in ids}

    mb = global_batch // n_microbatches  # dp-global microbatch: what the planner sees
    first = (torch.empty((mb, seq_len), dtype=torch.long, device="meta"),)
    metas = [build_stage_module(model_meta, f) for f in fqns_per_stage]
    pd = mixed_precision.param_dtype if mixed_precision is not None else None
    inputs = stage_input_shapes(metas, first, pd)
    logger.info("dry run: %d stages on a %s sub-mesh, microbatch %s (dp-global), profile %s",
                n_stages, tuple(sub_mesh.shape), tuple(first[0].shape), profile)

    tt_plans: list[tuple] = []
    budgets = []
    for s, (stage, x) in enumerate(zip(metas, inputs)):
        if compare:
            tt_plans.append(_plan_torchtitan(stage, x, sub_mesh, profile, s, first=s == 0,
                                             last=s == n_stages - 1,
                                             mixed_precision=mixed_precision,
                                             n_microbatches=n_microbatches))
        budget = memory_budget_bytes
        if compare and budget is None:
            budget = tt_plans[s][0].param_bytes_per_device * (1 + 1e-9)
        budgets.append(budget)
    last_kinds = ("batch", "vocab") if tp > 1 and loss_parallel is not False else ("batch",)
    if loss_parallel and tp > 1:
        last_kinds = ("vocab",)
    timings: dict[int, list] = {}
    bounds, plan_of = plan_pipeline(metas, inputs, sub_mesh, profile=profile, budgets=budgets,
                                    boundary=boundary, last_kinds=last_kinds, timings=timings,
                                    mixed_precision=mixed_precision,
                                    n_microbatches=n_microbatches,
                                    rank_of=[rank_of[s] for s in range(n_stages)])
    logits = last_stage_output(metas, inputs, mixed_precision)
    stages = []
    for s, x in enumerate(inputs):
        plan = plan_of(s)
        wall, n_solved, _ = timings.get(s, [0.0, 0, 1])
        kind = bounds[s + 1]
        if s + 1 < n_stages:
            out_t = inputs[s + 1][0]
            shape = [out_t.shape[0] // dp, *out_t.shape[1:]]
            if kind == "batch+seq":
                shape[1] //= tp
            shape, send = tuple(shape), boundary_bytes(out_t, dp, tp, kind)
        else:
            shape, send = None, 0
        last = s == n_stages - 1
        act = None
        if activations:
            t0 = time.perf_counter()
            act = activation_bytes_per_microbatch(metas[s], plan, sub_mesh, x)
            logger.info("stage %d: lowered to local graphs in %.1f s: %s kept per microbatch",
                        s, time.perf_counter() - t0, _bytes(act))
        logger.info("stage %d/%d (%s): %.3f ms per microbatch, %s params/device, planned in "
                    "%.1f s (%d solved)", s, n_stages, compact_modules(fqns_per_stage[s]),
                    plan.step_time_s * 1e3, _bytes(plan.param_bytes_per_device), wall,
                    n_solved)
        tt = tt_plans[s] if compare else (None, 0.0, False)
        stages.append(StageReport(
            index=s, pp_rank=rank_of[s], modules=compact_modules(fqns_per_stage[s]),
            input_shapes=tuple(tuple(t.shape) for t in x if isinstance(t, torch.Tensor)),
            plan=plan, plan_wall_s=wall, cached=n_solved == 0, send_shape=shape,
            send_bytes=send, torchtitan=tt[0], torchtitan_wall_s=tt[1], torchtitan_cached=tt[2],
            boundary_out=kind, loss_s=plan.loss_s, activation_bytes=act,
            torchtitan_loss_s=loss_time_s(logits, sub_mesh, profile, "vocab" if tp > 1 else
                                          "batch") if last and compare else 0.0,
        ))
    notes = ()
    if compare:
        notes = (
            "torchtitan's parameters fixed to its FSDP (S(0) on dp) + TP placements (wq/wk/wv/"
            "wqkv/w1/w3 and the embedding and output projection S(0), wo/w2 S(1), norms R on "
            "tp); its activation placements are re-optimised by the same solver",
            "each stage is planned under " + (
                "the given parameter-memory budget" if memory_budget_bytes is not None else
                "the parameter memory torchtitan's layout uses for it"),
        )
    return DryRunReport(
        pp=pp, dp=dp, tp=tp, schedule=str(schedule), n_microbatches=n_microbatches,
        global_batch=global_batch, seq_len=seq_len, profile=profile,
        memory_budget_bytes=memory_budget_bytes, stages=tuple(stages),
        stage_ids_per_rank=ids_per_rank, compare=compare, compare_notes=notes,
        mixed_precision=None if mixed_precision is None else
        f"parameters computed in {pd}, gradients reduced in {mixed_precision.reduce_dtype}",
    )
