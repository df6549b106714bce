"""``autopp.search``: the best pp × dp × tp, schedule, microbatches, split and recomputation
for a model, a number of devices and a global batch.

How it works (docs/design.md, "Configuration search"):

1. :func:`~autopp.layout_search.layouts.enumerate_layouts` lists the layouts (and what it leaves
   out, with the reason).
2. For each distinct (dp, tp) sub-mesh, :func:`~autopp.layout_search.unit_costs.probe_costs` plans
   two probe stages with the sharding planner (through the plan cache) under each
   recomputation policy: what the pre modules, one layer and the post modules cost on one
   device, at a reference microbatch. Every layout with that sub-mesh reuses them.
3. Each layout is priced without planning again: costs rescaled to its microbatch; the
   split chosen by :func:`~autopp.stage_split.balanced.balanced_cuts` (Alpa's stage DP over
   per-layer costs, each stage under the fastest recomputation policy whose memory fits the
   device with the microbatches the schedule keeps in flight on it); then torch's own action
   lists for the schedule run through the simulator (:func:`autopp.schedules.simulate_schedule`)
   for the step time, the bubble and each pp rank's peak memory.
4. Feasible layouts are ranked by simulated step time; :meth:`SearchReport.plan` plans a
   chosen one exactly (every stage, every boundary, memory-bound) as the dry run does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopp.layout_search.layouts import DEFAULT_SCHEDULES, Layout, enumerate_layouts
from autopp.layout_search.unit_costs import ZERO, ShapeCosts, UnitCost, probe_costs

__all__ = ["Candidate", "SearchReport", "search"]

logger = logging.getLogger(__name__)

_MODES = ("none", "selective", "full")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A priced layout (a row of :class:`SearchReport`)."""

    layout: Layout
    fqns_per_stage: tuple[tuple[str, ...], ...]
    """The split: module FQNs per stage."""
    layers_per_stage: tuple[int, ...]
    recompute: tuple[str, ...]
    """Per stage, the recomputation policy that fits."""
    step_time_s: float
    bubble_fraction: float
    tokens_per_s_per_device: float
    mfu: float
    """Model FLOPs utilisation: 6 × parameters × tokens per step over the step time and the
    devices' peak (the profile's, in the compute dtype); attention's own FLOPs not counted."""
    peak_bytes: tuple[int, ...]
    """Per pp rank, the simulated peak."""
    usable_bytes: float
    largest: str
    """The largest memory consumers at the fullest rank's peak."""
    simulation: Any = field(default=None, compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return max(self.peak_bytes) <= self.usable_bytes


@dataclass(frozen=True, slots=True)
class SearchReport:
    """What :func:`search` found."""

    results: tuple[Candidate, ...]
    """Feasible layouts, fastest first."""
    rejected: tuple[tuple[str, str], ...]
    """(layout, reason) for every layout left out or found not to fit."""
    world_size: int
    global_batch: int
    seq_len: int
    profile: str
    mixed_precision: Any
    n_evaluated: int
    n_submeshes: int
    stage_plans_solved: int
    search_s: float
    model: nn.Module = field(compare=False, repr=False, default=None)

    @property
    def best(self) -> Candidate:
        if not self.results:
            raise ValueError(self.no_fit_message())
        return self.results[0]

    def no_fit_message(self) -> str:
        fits = [r for _, r in self.rejected if "does not fit" in r]
        hint = fits[0] if fits else (self.rejected[0][1] if self.rejected else "")
        return (f"no layout of {self.world_size} devices fits: {hint}. What would make it "
                "fit: more devices (pp or tp shard parameters and activations further), a "
                "smaller global batch or sequence (fewer activations per microbatch), or a "
                "larger device (profile).")

    def table(self, n: int = 10) -> str:
        """The ``n`` fastest layouts as a text table."""
        head = (f"{'#':>3}  {'layout':42} {'split (layers)':22} {'recompute':10} "
                f"{'step ms':>9} {'bubble':>7} {'tok/s/dev':>10} {'MFU':>6} {'peak GiB':>9}")
        rows = [head]
        for i, c in enumerate(self.results[:n]):
            split = "-".join(map(str, c.layers_per_stage))
            if len(split) > 22:
                split = split[:19] + "..."
            rec = "/".join(sorted(set(c.recompute)))
            rows.append(f"{i + 1:>3}  {str(c.layout):42} {split:22} {rec:10} "
                        f"{c.step_time_s * 1e3:>9.1f} {c.bubble_fraction:>7.1%} "
                        f"{c.tokens_per_s_per_device:>10.1f} {c.mfu:>6.1%} "
                        f"{max(c.peak_bytes) / 2**30:>9.2f}")
        return "\n".join(rows)

    def __str__(self) -> str:
        lines = [
            f"Search: {self.world_size} devices ({self.profile}), global batch "
            f"{self.global_batch} x seq {self.seq_len}: {self.n_evaluated} layouts priced on "
            f"{self.n_submeshes} sub-mesh shapes ({self.stage_plans_solved} probe stage plans "
            f"solved), {len(self.results)} fit; {self.search_s:.1f} s",
        ]
        if self.results:
            lines += [self.table(), "", f"best: {self.best.layout}; largest memory at its "
                                        f"peak: {self.best.largest}"]
        else:
            lines.append(self.no_fit_message())
        if self.rejected:
            lines.append(f"left out: {len(self.rejected)} (e.g. {self.rejected[0][0]}: "
                         f"{self.rejected[0][1]})")
        return "\n".join(lines)

    def plan(self, index: int = 0, **dry_run_kwargs: Any) -> Any:
        """Plan the ``index``-th layout exactly (:func:`autopp.dry_run.dry_run` with its split:
        every stage planned under the device's memory, boundaries chosen, simulated) and
        return the dry run's report; ``report.plan`` is the
        :class:`~autopp.pipeline_plan.PipelinePlan` to save and train with."""
        from autopp.dry_run import dry_run

        c = self.results[index]
        lay = c.layout
        return dry_run(self.model, pp=lay.pp, dp=lay.dp, tp=lay.tp, schedule=lay.schedule,
                       n_microbatches=lay.n_microbatches, global_batch=self.global_batch,
                       seq_len=self.seq_len, profile=self.profile,
                       mixed_precision=self.mixed_precision,
                       split=[list(f) for f in c.fqns_per_stage], **dry_run_kwargs)


def _largest(mem: Any) -> str:
    parts = sorted(((getattr(mem, k), k.replace("_", " ")) for k in (
        "parameters", "gradients", "optimizer", "gathered_parameters", "activations")),
        reverse=True)
    return ", ".join(f"{name} {b / 2**30:.1f} GiB" for b, name in parts[:2] if b)


class _Pricer:
    """Prices layouts from probe costs (one per sub-mesh shape)."""

    def __init__(self, model: nn.Module, layout_info: Any, *, global_batch: int, seq_len: int,
                 profile: Any, mixed_precision: Any, modes: Sequence[str], usable: float):
        self.model, self.layout = model, layout_info
        self.global_batch, self.seq_len = global_batch, seq_len
        self.profile, self.mp, self.modes, self.usable = profile, mixed_precision, modes, usable
        self.shapes: dict[tuple[int, int], ShapeCosts] = {}
        self.send: dict[tuple[int, int], float] = {}
        self.n_params = sum(p.numel() for p in model.parameters())
        dtype = getattr(mixed_precision, "param_dtype", None) or next(
            model.parameters()).dtype
        self.peak_flops = profile.flops_bf16 if dtype in (torch.bfloat16, torch.float16) \
            else profile.flops_fp32

    def add(self, shape: ShapeCosts) -> None:
        """Take a probe's costs (merged with those of other recompute policies)."""
        key = (shape.dp, shape.tp)
        old = self.shapes.get(key)
        if old is not None:
            shape = dataclasses.replace(
                shape, pre={**old.pre, **shape.pre}, layer={**old.layer, **shape.layer},
                post={**old.post, **shape.post}, planning_s=old.planning_s + shape.planning_s,
                solved=old.solved + shape.solved)
        self.shapes[key] = shape
        # a layer's output per device: batch split over dp, sequence over tp
        self.send[key] = shape.hidden_bytes / shape.dp / shape.tp

    def price(self, lay: Layout, shape: ShapeCosts) -> Candidate | str:
        from autopp.auto_plan import in_flight_per_stage
        from autopp.estimate import pp_link
        from autopp.schedules import StageCost, simulate_schedule

        n, L = lay.n_stages, self.layout.n_layers
        modes = [m for m in shape.layer]  # policies, and their "@lean" variants, probed
        ref_rows = shape.rows
        rows = self.global_batch // lay.n_microbatches
        f = rows / ref_rows
        layer = {m: shape.layer[m].scaled(f) for m in modes}
        pre = {m: shape.pre[m].scaled(f) for m in modes}
        post = {m: shape.post[m].scaled(f) for m in modes}
        loss = shape.loss_s * f
        in_flight = in_flight_per_stage(lay.schedule, lay.pp, lay.n_microbatches, n)
        budget = self.usable / lay.stages_per_rank

        def unit_sum(s: int, k: int, mode: str) -> UnitCost:
            c = layer[mode]
            total = ZERO
            for _ in range(k):
                total = total + c
            if s == 0:
                total = total + pre[mode]
            if s == n - 1:
                total = total + post[mode]
            return total

        memo: dict[tuple[int, int, bool, bool], tuple[float, str]] = {}

        def best_mode(s: int, k: int) -> tuple[float, str]:
            key = (min(in_flight[s], 1 << 30), k, s == 0, s == n - 1)
            hit = memo.get(key)
            if hit is None:
                hit = (math.inf, "")
                for mode in modes:
                    u = unit_sum(s, k, mode)
                    mem = u.state_total() + u.gathered_bytes + in_flight[s] * u.activation_bytes
                    if mem <= budget:
                        t = u.per_microbatch_s + (loss if s == n - 1 else 0.0)
                        if t < hit[0]:
                            hit = (t, mode)
                memo[key] = hit
            return hit

        from autopp.stage_split.balanced import balanced_cuts

        cuts = balanced_cuts([1.0] * L, n,
                             stage_cost=lambda s, i, j: best_mode(s, j - i)[0])
        if cuts is None:
            def need(mode: str) -> float:
                u = unit_sum(0, max(1, L // n), mode)
                return u.state_total() + u.gathered_bytes + in_flight[0] * u.activation_bytes

            least = min(modes, key=need)
            lean = ", memory-lean placements" if "@" in least else ""
            return (f"does not fit: even its least-memory plan probed (recompute="
                    f"{least.split('@')[0]!r}{lean}) needs ~{need(least) / 2**30:.1f} GiB for the first stage of "
                    f"{budget / 2**30:.1f} GiB ({in_flight[0]} microbatches in flight)")
        counts = [b - a for a, b in zip(cuts, cuts[1:])]
        chosen = [best_mode(s, k)[1].split("@")[0] for s, k in enumerate(counts)]
        send = self.send[(lay.dp, lay.tp)] * f
        costs = []
        for s, k in enumerate(counts):
            u = unit_sum(s, k, best_mode(s, k)[1])
            base = max(u.per_microbatch_s - u.recompute_s, 0.0) / 3
            ls = loss if s == n - 1 else 0.0
            costs.append(StageCost(
                forward_s=base + ls / 2, backward_input_s=base + u.recompute_s + ls / 2,
                backward_weight_s=base, unshard_s=u.unshard_s, reduce_grad_s=u.reduce_grad_s,
                activation_bytes_per_microbatch=int(u.activation_bytes),
                p2p_bytes_per_microbatch=int(send) if s < n - 1 else 0,
                param_bytes=int(u.state.parameters), grad_bytes=int(u.state.gradients),
                unreduced_grad_bytes=int(u.state.unreduced_gradients),
                optimizer_bytes=int(u.state.optimizer), gathered_param_bytes=int(u.gathered_bytes),
            ))
        link = pp_link(self.profile, (lay.pp, lay.dp, lay.tp))
        sim = simulate_schedule(lay.schedule, costs, pp=lay.pp, n_microbatches=lay.n_microbatches,
                                n_stages=n, link=link)
        peaks = tuple(r.peak_bytes for r in sim.ranks)
        worst = max(range(len(peaks)), key=lambda r: peaks[r])
        largest = _largest(sim.ranks[worst].memory_at_peak)
        if peaks[worst] > self.usable:
            return (f"does not fit: pp rank {worst} peaks at {peaks[worst] / 2**30:.1f} GiB > "
                    f"{self.usable / 2**30:.1f} GiB usable ({largest})")
        layers = self.layout.layer_fqns
        fqns = [list(layers[a:b]) for a, b in zip(cuts, cuts[1:])]
        fqns[0] = [*self.layout.pre, *fqns[0]]
        fqns[-1] = [*fqns[-1], *self.layout.post]
        world = lay.pp * lay.dp * lay.tp
        tokens = self.global_batch * self.seq_len
        step = sim.step_time_s
        cores = self.profile.shared_cores
        if cores:  # ranks share the CPU: rates were measured with every rank busy, so an
            # idle rank's cores go to the others; the machine's total work bounds the step
            mean_busy = sum(r.busy_s for r in sim.ranks) / len(sim.ranks)
            step = max(mean_busy, step * min(1.0, cores / world))
        return Candidate(
            layout=lay, fqns_per_stage=tuple(tuple(x) for x in fqns),
            layers_per_stage=tuple(counts), recompute=tuple(chosen), step_time_s=step,
            bubble_fraction=sim.bubble_fraction,
            tokens_per_s_per_device=tokens / step / world,
            mfu=6 * self.n_params * tokens / step / (world * self.peak_flops),
            peak_bytes=peaks, usable_bytes=self.usable, largest=largest, simulation=sim,
        )


_JOB: dict[str, Any] = {}
"""What probe jobs read: set before the worker processes are forked (they inherit it)."""


def _probe_job(dp: int, tp: int, pp: int, m_ref: int, modes: tuple[str, ...]
               ) -> ShapeCosts | str:
    """Probe one sub-mesh (in a worker process or this one): its costs, or why not."""
    from autopp.mesh import build_world_mesh, init_fake_world, stage_sub_mesh

    j = _JOB
    if not dist.is_initialized():
        init_fake_world(j["world"])
    try:
        sub = stage_sub_mesh(build_world_mesh(pp=pp, dp=dp, tp=tp, device_type="cpu"))
        tokens = torch.empty((j["global_batch"] // dp, j["seq_len"]), dtype=torch.long,
                             device="meta")
        return probe_costs(j["model"], j["layout"], sub, tokens=tokens, n_microbatches=m_ref,
                           profile=j["profile"], boundary="batch+seq" if tp > 1 else "batch",
                           loss_kind="vocab" if tp > 1 else "batch", modes=modes,
                           mixed_precision=j["mp"])
    except Exception as e:  # noqa: BLE001 - a sub-mesh the planner cannot plan
        return f"the planner could not plan this sub-mesh: {e}".split("\n")[0]


def _run_probes(jobs: list[tuple], workers: int, done: Any) -> list[ShapeCosts | str]:
    """Run probe jobs, on ``workers`` forked processes when more than one."""
    if workers <= 1 or len(jobs) <= 1:
        out = []
        for job in jobs:
            out.append(_probe_job(*job))
            done(job)
        return out
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
        pending = [pool.apply_async(_probe_job, job) for job in jobs]
        out = []
        for job, p in zip(jobs, pending):
            out.append(p.get())
            done(job)
        return out


def search(
    model_meta: nn.Module,
    *,
    world_size: int,
    global_batch: int,
    seq_len: int,
    profile: str = "H100",
    mixed_precision: Any = None,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    tp_sizes: Sequence[int] | None = None,
    pp_sizes: Sequence[int] | None = None,
    recompute: Sequence[str] = ("none", "selective", "full"),
    memory_reserve: float = 0.1,
    microbatch_choices: int = 3,
    max_results: int | None = None,
    layers_attr: str | None = None,
    workers: int | None = None,
) -> SearchReport:
    """Find the fastest layouts of ``model_meta`` on ``world_size`` devices.

    Args:
        model_meta: the whole model on the meta device (a decoder whose blocks repeat); its
            first input is a ``(batch, seq_len)`` int64 token tensor.
        world_size: devices in all (pp × dp × tp of every layout).
        global_batch: sequences per training step, over all dp ranks.
        seq_len: tokens per sequence.
        profile: the device profile ("H100", "H200", "A100", "CPU", or a measured one).
        mixed_precision: torch's ``MixedPrecisionPolicy`` (e.g. bf16 compute, fp32
            gradients), as for :func:`autopp.pipeline_autoparallel`.
        schedules: pipeline schedules to consider (torch's names).
        tp_sizes / pp_sizes: restrict tp / pp; None: every size that divides the world
            (tp within a node, pp up to the number of layers).
        recompute: recomputation policies a stage may use (each stage takes the fastest
            that fits).
        memory_reserve: share of each device's memory kept out of the plan (allocator,
            buffers).
        microbatch_choices: microbatch counts tried per layout (fewest first, doubling).
        max_results: keep only this many feasible layouts (None: all).
        layers_attr: path of the model's block container (None: found).
        workers: processes probing sub-meshes at once (None: up to 2, this machine's cores
            permitting; 1: in this process). Probes under "none" come first; the other
            recomputation policies are probed only on sub-meshes where some layout does not
            fit without them.

    Returns a :class:`SearchReport`; raises ValueError when no layout exists at all.
    """
    from autopp.estimate import usable_bytes
    from autopp.sharding.profiles import get_profile
    from autopp.stage_split import inspect_model

    t0 = time.perf_counter()
    for m in recompute:
        if m not in _MODES:
            raise ValueError(f"recompute policies are {_MODES}, got {m!r}")
    prof = get_profile(profile)
    usable = usable_bytes(prof, memory_reserve)
    layout_info = inspect_model(model_meta, layers_attr)
    layouts, rejected = enumerate_layouts(
        world_size=world_size, global_batch=global_batch, n_layers=layout_info.n_layers,
        devices_per_node=prof.devices_per_node, schedules=schedules, tp_sizes=tp_sizes,
        pp_sizes=pp_sizes, microbatch_choices=microbatch_choices)
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"torch.distributed is initialised with {dist.get_world_size()} ranks; "
                         f"the search needs a fake world of {world_size}")
    workers = min(2, os.cpu_count() or 1) if workers is None else workers
    pricer = _Pricer(model_meta, layout_info, global_batch=global_batch, seq_len=seq_len,
                     profile=prof, mixed_precision=mixed_precision, modes=tuple(recompute),
                     usable=usable)
    families: dict[tuple[int, int], list[Layout]] = {}
    for lay in layouts:
        families.setdefault((lay.dp, lay.tp), []).append(lay)
    _JOB.update(model=model_meta, layout=layout_info, world=world_size,
                global_batch=global_batch, seq_len=seq_len, profile=prof.name,
                mp=mixed_precision)
    logger.info("search: %d layouts over %d sub-mesh shapes (%d left out before pricing), "
                "%d probe process(es)", len(layouts), len(families), len(rejected), workers)
    progress = {"n": 0, "total": 0, "last": time.perf_counter()}

    def done(job: tuple) -> None:
        progress["n"] += 1
        now = time.perf_counter()
        if now - progress["last"] > 5 or progress["n"] == progress["total"]:
            logger.info("search: probed %d/%d sub-meshes (dp=%d tp=%d, recompute %s), %.1f s",
                        progress["n"], progress["total"], job[0], job[1], "/".join(job[4]),
                        now - t0)
            progress["last"] = now

    def probe(keys: list[tuple[int, int]], modes: tuple[str, ...]) -> dict:
        jobs = []
        for dp, tp in keys:
            fam = families[dp, tp]
            m_ref = sorted(lay.n_microbatches for lay in fam)[len(fam) // 2]
            jobs.append((dp, tp, fam[0].pp, m_ref, modes))
        progress["n"], progress["total"] = 0, len(jobs)
        return dict(zip(keys, _run_probes(jobs, workers, done)))

    priced: dict[Layout, Candidate | str] = {}

    def price(keys: list[tuple[int, int]], shapes: dict) -> None:
        for key in keys:
            got = shapes[key]
            if isinstance(got, str):
                priced.update((lay, got) for lay in families[key])
                continue
            pricer.add(got)
            for lay in families[key]:
                priced[lay] = pricer.price(lay, pricer.shapes[key])
        fits = [c for c in priced.values() if not isinstance(c, str)]
        best = min(fits, key=lambda c: c.step_time_s) if fits else None
        logger.info("search: %d/%d layouts priced, %.1f s; best so far %s", len(priced),
                    len(layouts), time.perf_counter() - t0,
                    f"{best.layout} {best.step_time_s * 1e3:.1f} ms" if best else "none fits")

    created = not dist.is_initialized()  # in-process probes set up a fake world
    keys = sorted(families)
    # time-optimal probes under "none" first; where a layout does not fit, the other
    # policies and the least-memory ("@lean": weights sharded as far as they go) probes
    first = ("none",) if "none" in recompute else tuple(recompute[:1])
    rest = tuple(m for m in recompute if m not in first) + tuple(
        f"{m}@lean" for m in recompute if m != "selective")
    try:
        price(keys, probe(keys, first))
        again = [k for k in keys if rest and k in pricer.shapes and any(
            isinstance(priced[lay], str) and priced[lay].startswith("does not fit")
            for lay in families[k])]
        if again:
            logger.info("search: %d sub-mesh(es) have layouts that do not fit without "
                        "recomputation: probing recompute %s", len(again), "/".join(rest))
            price(again, probe(again, rest))
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    results = [c for c in priced.values() if not isinstance(c, str)]
    rej = list(rejected) + [(str(lay), c) for lay, c in priced.items() if isinstance(c, str)]
    results.sort(key=lambda c: c.step_time_s)
    if max_results is not None:
        results = results[:max_results]
    return SearchReport(
        results=tuple(results), rejected=tuple(rej), world_size=world_size,
        global_batch=global_batch, seq_len=seq_len, profile=prof.name,
        mixed_precision=mixed_precision, n_evaluated=len(layouts), n_submeshes=len(families),
        stage_plans_solved=sum(s.solved for s in pricer.shapes.values()),
        search_s=time.perf_counter() - t0, model=model_meta,
    )
