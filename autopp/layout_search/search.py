"""``autopp.search``: the best pp × dp × tp, schedule, microbatches, split and recomputation
for a model, a number of devices and a global batch (docs/design.md, "layout_search/").

What: the layouts (:func:`~autopp.layout_search.layouts.enumerate_layouts`); per distinct
(dp, tp) sub-mesh, probe stage plans on worker processes (each kind of layer, first under
"none"); each layout priced from them without planning again (:mod:`.pricing`: the split,
each stage's fastest fitting policy, a lower bound, then the simulator, least bound first);
sub-meshes whose unfit layouts could beat the best that fits probed again under the other
recomputation policies and memory-lean placements. Why: an exact plan per layout would take
minutes each. Invariant: a layout left out as dominated has a bound no faster than the
``max_results``-th fastest; :meth:`SearchReport.plan` plans a chosen layout exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from autopp.layout_search.layouts import DEFAULT_SCHEDULES, Layout, enumerate_layouts
from autopp.layout_search.pricing import Candidate, Pricer, Split
from autopp.layout_search.probe_pool import JOB, PROBE_BUG, ProbePool
from autopp.layout_search.unit_costs import ShapeCosts, layer_kinds
from autopp.plan.heap import frozen_heap
from autopp.plan.options import PlannerOptions, changed_fields, refuse_loose

__all__ = ["Candidate", "SearchReport", "search"]

logger = logging.getLogger(__name__)

_MODES = ("none", "selective", "full")


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
    memory_reserve: float = 0.1
    """The share of device memory the search kept out of every layout's fit."""
    tf32: bool = False
    """fp32 matmuls priced at the TF32 rate (the options' ``tf32``)."""
    options: Any = None
    """The :class:`~autopp.plan.options.PlannerOptions` the layouts were priced with (its
    profile resolved); :meth:`plan` plans with them unless given others."""
    without_pipeline: Candidate | str | None = None
    """The fastest layout with no pipeline (pp = 1: FSDP + TP), or why none fits (None:
    none was considered)."""
    layer_kinds: tuple[int, ...] = ()
    """Per layer, its kind (:func:`~autopp.layout_search.unit_costs.layer_kinds`), each
    kind probed and priced at its own cost."""

    @property
    def best(self) -> Candidate:
        if not self.results:
            raise ValueError(self.no_fit_message())
        return self.results[0]

    def rejected_by_kind(self) -> dict[str, list[tuple[str, str]]]:
        """The rejected layouts by why: "memory" (priced, does not fit), "planner" (the
        planner failed on its sub-mesh), "shape" (the sizes do not divide: batch, layers,
        microbatches, node size), "dominated" (fits, but cannot be among the fastest),
        "bug" (probing raised something other than the planner's refusals: autopp's fault)."""
        out: dict[str, list[tuple[str, str]]] = {"planner": [], "memory": [], "shape": [],
                                                 "dominated": [], "bug": []}
        for lay, why in self.rejected:
            kind = ("memory" if why.startswith("does not fit") else
                    "bug" if why.startswith(PROBE_BUG) else
                    "planner" if why.startswith("the planner could not plan") else
                    "dominated" if why.startswith("dominated") else "shape")
            out[kind].append((lay, why))
        return out

    def no_fit_message(self) -> str:
        """Why no layout fits, per kind of reason, and only the remedies for those kinds."""
        kinds = self.rejected_by_kind()
        label = {"bug": "autopp failed while probing", "planner": "the planner failed",
                 "memory": "do not fit in memory", "shape": "sizes do not divide"}
        parts = [f"{len(kinds[k])} layout(s): {label[k]} (e.g. {kinds[k][0][0]}: "
                 f"{kinds[k][0][1]})" for k in ("bug", "planner", "memory", "shape")
                 if kinds[k]]
        fixes = []
        if kinds["bug"]:
            fixes.append("a fix in autopp for the probing error (please report it; "
                         "AUTOPP_TRACEBACK=1 logs its traceback)")
        if kinds["memory"]:
            fixes.append("more devices (pp or tp shard parameters and activations "
                         "further), a smaller global batch or sequence (fewer activations "
                         "per microbatch), or a larger device (profile)")
        if kinds["shape"]:
            fixes.append("a global batch divisible by more dp sizes, or another world size")
        if kinds["planner"]:
            fixes.append("leaving out the tp sizes the planner failed on (tp_sizes=...): "
                         "its failure is a limit of autopp's planner, not of the layout")
        return (f"no layout of {self.world_size} devices fits: " + "; ".join(parts)
                + (". What would make it fit: " + "; or ".join(fixes) if fixes else "")
                + ".")

    def table(self, n: int = 10) -> str:
        """The ``n`` fastest layouts as a text table (with the routed experts' layout and
        token dispatch of each, for a mixture-of-experts model)."""
        moe = any(e for c in self.results[:n] for e in c.experts)
        head = (f"{'#':>3}  {'layout':42} {'split (layers)':22} {'recompute':20} "
                f"{'weights':10} " + (f"{'experts':16} " if moe else "")
                + f"{'step ms':>9} {'bubble':>7} {'tok/s/dev':>10} {'MFU':>6} {'peak GiB':>9}")
        rows = [head]
        for i, c in enumerate(self.results[:n]):
            split = "-".join(map(str, c.layers_per_stage))
            if len(split) > 22:
                split = split[:19] + "..."
            rec = "/".join(sorted(set(c.recompute)))
            held = "/".join(sorted({_GATHERING_WORDS[g] for g in c.weight_gathering})) or "-"
            ex = "/".join(dict.fromkeys(e for e in c.experts if e)) or "-"
            rows.append(f"{i + 1:>3}  {str(c.layout):42} {split:22} {rec:20} {held:10} "
                        + (f"{ex:16} " if moe else "") + f"{c.step_time_s * 1e3:>9.1f} {c.bubble_fraction:>7.1%} "
                        f"{c.tokens_per_s_per_device:>10.1f} {c.mfu:>6.1%} "
                        f"{max(c.peak_bytes) / 2**30:>9.2f}")
        if any("per_block" in c.weight_gathering for c in self.results[:n]):
            rows.append("weights: 'step' gathered once per step, 'block' block by block "
                        "(weight_gathering='per_block', as FSDP)")
        if moe:
            rows.append("experts: the mesh dims the routed experts are split over, tokens "
                        "sent to them by all-to-all (a2a) or all-gathered (ag); 'whole': "
                        "every device holds every expert")
        return "\n".join(rows)

    def moe_assumption(self) -> str:
        """What the pricing assumes about routing (``PlannerOptions.expert_imbalance``)."""
        f = float(getattr(self.options, "expert_imbalance", 1.0))
        kinds = (f"; {max(self.layer_kinds) + 1} kinds of layers priced apart "
                 f"({', '.join(f'{self.layer_kinds.count(k)} of kind {k}' for k in range(max(self.layer_kinds) + 1))})"
                 if self.layer_kinds and max(self.layer_kinds) else "")
        if f == 1:
            return ("MoE load balance: routing assumed uniform over the experts "
                    "(PlannerOptions.expert_imbalance=1)" + kinds)
        return (f"MoE load balance: the busiest expert-parallel device priced at {f:g}x the "
                f"mean routed tokens (PlannerOptions.expert_imbalance={f:g})" + kinds)

    def __str__(self) -> str:
        lines = [
            f"Search: {self.world_size} devices ({self.profile}), global batch "
            f"{self.global_batch} x seq {self.seq_len}: {self.n_evaluated} layouts priced on "
            f"{self.n_submeshes} sub-mesh shapes ({self.stage_plans_solved} probe stage plans "
            f"solved), the {len(self.results)} fastest that fit ranked; {self.search_s:.1f} s",
        ]
        if any(e for c in self.results for e in c.experts):
            lines.append(self.moe_assumption())
        if self.results:
            lines += [self.table(), "", f"best: {self.best.layout}; largest memory at its "
                                        f"peak: {self.best.largest}"]
            lines.append(self._against_fsdp())
        else:
            lines.append(self.no_fit_message())
        if self.rejected:
            lines.append(f"left out: {len(self.rejected)} (e.g. {self.rejected[0][0]}: "
                         f"{self.rejected[0][1]})")
        return "\n".join(lines)

    def _against_fsdp(self) -> str:
        """One line: the best layout against the best one without a pipeline."""
        other, best = self.without_pipeline, self.best
        if other is None:
            return "no layout without a pipeline (pp = 1) was considered"
        if isinstance(other, str):
            return f"without a pipeline (pp = 1, FSDP + TP): {other}"
        if other.layout == best.layout:
            return "the best layout has no pipeline (FSDP + TP)"
        held = "/".join(sorted({_GATHERING_WORDS[g] for g in other.weight_gathering}))
        return (f"without a pipeline the best is {other.layout} (weights gathered by {held}):"
                f" {other.step_time_s * 1e3:.1f}"
                f" ms a step, {max(other.peak_bytes) / 2**30:.1f} GiB peak; the best is "
                f"{other.step_time_s / best.step_time_s:.2f}x faster ({best.mfu:.1%} MFU "
                f"against {other.mfu:.1%}; its pipeline bubble {best.bubble_fraction:.1%})")

    def plan(self, index: int = 0, options: Any = None, **dry_run_kwargs: Any) -> Any:
        """Plan the ``index``-th layout exactly (:func:`autopp.dry_run.dry_run` with its split:
        every stage planned under the device's memory, boundaries chosen, simulated) and
        return the dry run's report; ``report.plan`` is the
        :class:`~autopp.plan.value.PipelinePlan` to save and train with. A layout with a stage
        priced gathering block by block is planned with ``weight_gathering="per_block"`` (the
        planner's mode is the whole pipeline's)."""
        from autopp.dry_run.run import dry_run

        c = self.results[index]
        if options is None:  # what the search ranked the layout with
            options = self.options if self.options is not None else PlannerOptions(
                profile=self.profile, mixed_precision=self.mixed_precision,
                memory_reserve=self.memory_reserve, tf32=self.tf32)
        if "per_block" in c.weight_gathering and options.weight_gathering == "once_per_step":
            options = dataclasses.replace(options, weight_gathering="per_block")
        lay = c.layout
        return dry_run(self.model, pp=lay.pp, dp=lay.dp, tp=lay.tp, schedule=lay.schedule,
                       n_microbatches=lay.n_microbatches, global_batch=self.global_batch,
                       seq_len=self.seq_len, options=options,
                       split=[list(f) for f in c.fqns_per_stage], **dry_run_kwargs)


class _UnfitBounds:
    """Per sub-mesh, lower bounds on the step of each layout that does not fit without
    recomputation: its step with unlimited memory (recomputing and memory-lean placements
    only add time). Made, for every sub-mesh at once, from the busiest rank's compute
    (:meth:`least`); :meth:`simulated` then simulates one sub-mesh's most promising layouts until one beats the
    best that fits (a sub-mesh whose least bound does not is dominated, not worth probing
    again). The search asks :meth:`simulated` as that sub-mesh's probe is about to start, so
    the simulations run beside the other probes rather than before all of them."""

    def __init__(self, priced: dict, families: dict, pricer: Pricer, keys: list):
        self.pricer = pricer
        self.splits: dict[tuple[int, int], dict[Layout, Split | str]] = {}
        self.bounds: dict[tuple[int, int], dict[Layout, float]] = {}
        for key in keys:
            if key not in pricer.shapes:
                continue  # the planner could not plan it at all
            unfit = [lay for lay in families[key] if isinstance(priced[lay], str)
                     and priced[lay].startswith("does not fit")]
            if unfit:
                self.splits[key] = {lay: pricer.split(lay, usable=math.inf) for lay in unfit}
                self.bounds[key] = {lay: 0.0 if isinstance(sp, str) else sp.bound_s
                                    for lay, sp in self.splits[key].items()}
        self.done: set[tuple[int, int]] = set()

    def least(self, key: tuple[int, int]) -> float:
        return min(self.bounds[key].values())

    def simulated(self, key: tuple[int, int], best_s: float) -> float:
        """``key``'s least bound once its layouts are simulated, least cheap bound first,
        until one beats ``best_s``."""
        if key not in self.done:
            self.done.add(key)
            bounds, splits = self.bounds[key], self.splits[key]
            for lay in sorted(bounds, key=bounds.__getitem__):
                if bounds[lay] >= best_s:
                    break
                if not isinstance(splits[lay], str):
                    bounds[lay] = self.pricer.simulate(splits[lay]).step_time_s
                if bounds[lay] < best_s:
                    break
        return self.least(key)


def _ms(seconds: float) -> str:
    """Milliseconds to four significant digits at least."""
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 1000 else f"{ms:.4g}"


def _dominated(priced: dict, bounds: dict[Layout, float], best: Candidate) -> None:
    for lay, bound in bounds.items():
        priced[lay] = (f"{priced[lay]}; not probed with recomputation: even with unlimited "
                       f"memory its step is at least {_ms(bound)} ms, no faster than "
                       f"{best.layout} ({_ms(best.step_time_s)} ms) that fits")


@frozen_heap()  # the collector off the imported heap while searching
def search(
    model_meta: nn.Module,
    *,
    world_size: int,
    global_batch: int,
    seq_len: int,
    options: PlannerOptions | None = None,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    tp_sizes: Sequence[int] | None = None,
    pp_sizes: Sequence[int] | None = None,
    recompute: Sequence[str] = ("none", "selective", "full"),
    microbatch_choices: int = 3,
    stages_per_rank: Sequence[int] = (2, 3, 4),
    max_results: int | None = 20,
    layers_attr: str | None = None,
    workers: int | None = None,
    **old_keywords: Any,
) -> SearchReport:
    """Find the fastest layouts of ``model_meta`` (on meta, a decoder whose blocks repeat,
    token input ``(batch, seq_len)``) on ``world_size`` devices for ``global_batch``
    sequences of ``seq_len`` tokens a step.

    ``options``: the planner's options as a job would pass them; priced are ``profile``
    (None: "H100"), ``mixed_precision``, ``memory_budget_bytes`` / ``memory_reserve``,
    ``tf32`` and the MoE ones (``token_dispatch``, ``expert_dims``, ``expert_imbalance``);
    others are refused by name (plan the chosen layout with them). The search's own
    choices: ``schedules``; ``tp_sizes`` / ``pp_sizes`` (None: every divisor, tp within a
    node); the ``recompute`` policies a stage may take; ``microbatch_choices`` (doubling);
    ``stages_per_rank`` for the looped schedules; ``max_results`` to rank (a layout whose
    bound cannot enter them is left out as dominated; None: all); ``layers_attr`` (None:
    found); ``workers`` probing at once (None: up to 2; 1: in this process). Returns a
    :class:`SearchReport`; raises ValueError when no layout exists at all.
    """
    from autopp import adapters

    adapters.prepare(model_meta)  # e.g. a transformers model's attention (logged)
    from autopp.estimate.stage_costs import usable_bytes
    from autopp.profiles.lookup import get_profile
    from autopp.stage_split import inspect_model

    t0 = time.perf_counter()
    options = search_options(options, old_keywords)
    profile, mixed_precision = options.profile, options.mixed_precision
    memory_reserve, tf32 = options.memory_reserve, options.tf32
    for m in recompute:
        if m not in _MODES:
            raise ValueError(f"recompute policies are {_MODES}, got {m!r}")
    prof = get_profile(profile)
    usable = (usable_bytes(prof, memory_reserve) if options.memory_budget_bytes is None
              else float(options.memory_budget_bytes))
    layout_info = inspect_model(model_meta, layers_attr)
    layouts, rejected = enumerate_layouts(
        world_size=world_size, global_batch=global_batch, n_layers=layout_info.n_layers,
        devices_per_node=prof.devices_per_node, schedules=schedules, tp_sizes=tp_sizes,
        pp_sizes=pp_sizes, microbatch_choices=microbatch_choices,
        stages_per_rank=stages_per_rank,
        end_stages=int(bool(layout_info.pre)) + int(bool(layout_info.post)))
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"torch.distributed is initialised with {dist.get_world_size()} ranks; "
                         f"the search needs a fake world of {world_size}")
    workers = min(2, os.cpu_count() or 1) if workers is None else workers
    kinds = layer_kinds(model_meta, layout_info)  # dense and MoE layers priced apart
    pricer = Pricer(model_meta, layout_info, global_batch=global_batch, seq_len=seq_len,
                    profile=prof, mixed_precision=mixed_precision, usable=usable, tf32=tf32,
                    kinds=kinds)
    families: dict[tuple[int, int], list[Layout]] = {}
    for lay in layouts:
        families.setdefault((lay.dp, lay.tp), []).append(lay)
    JOB.update(model=model_meta, layout=layout_info, world=world_size,
                global_batch=global_batch, seq_len=seq_len, profile=prof.name,
                mp=mixed_precision, tf32=tf32, kinds=kinds,
                trace_settings=options.trace_settings())
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

    def probe(keys: list[tuple[int, int]], modes: tuple[str, ...], keep: Any = None,
              on_result: Any = None) -> dict:
        jobs = []
        for dp, tp in keys:
            fam = families[dp, tp]
            m_ref = sorted(lay.n_microbatches for lay in fam)[len(fam) // 2]
            jobs.append((dp, tp, fam[0].pp, m_ref, modes))
        progress["n"], progress["total"] = 0, len(jobs)

        def finished(job: tuple, result: Any) -> None:
            done(job)
            if on_result is not None:
                on_result(job[:2], result)

        got = pool.run(jobs, finished, keep)
        return {job[:2]: res for job, res in got.items()}

    def best_fit() -> Candidate | None:
        fits = [c for c in priced.values() if not isinstance(c, str)]
        return min(fits, key=lambda c: c.step_time_s) if fits else None

    priced: dict[Layout, Candidate | str] = {}

    def split(key: tuple[int, int], got: ShapeCosts | str) -> list[Split]:
        """A probed sub-mesh's layouts split into stages (those that cannot be: priced)."""
        if isinstance(got, str):
            priced.update((lay, got) for lay in families[key])
            return []
        pricer.add(got)
        splits = []
        for lay in families[key]:
            sp = pricer.split(lay)
            if isinstance(sp, str):
                priced[lay] = sp
            else:
                priced.pop(lay, None)
                splits.append(sp)
        return splits

    def price(splits: list[Split]) -> None:
        # least bound first; stop simulating what cannot make the max_results fastest
        steps = sorted(c.step_time_s for c in priced.values() if not isinstance(c, str))
        dominated = 0
        for sp in sorted(splits, key=lambda sp: sp.bound_s):
            if max_results is not None and len(steps) >= max_results and \
                    sp.bound_s >= steps[max_results - 1]:
                priced[sp.layout] = (
                    f"dominated: its step is at least {_ms(sp.bound_s)} ms (its busiest "
                    f"pp rank's compute alone), no faster than the {max_results} fastest "
                    f"(up to {_ms(steps[max_results - 1])} ms)")
                dominated += 1
                continue
            got = priced[sp.layout] = pricer.simulate(sp)
            if not isinstance(got, str):
                bisect.insort(steps, got.step_time_s)
        best = best_fit()
        logger.info("search: %d/%d layouts priced (%d simulated, %d dominated), %.1f s; best "
                    "so far %s", len(priced), len(layouts), len(splits) - dominated, dominated,
                    time.perf_counter() - t0,
                    f"{best.layout} {best.step_time_s * 1e3:.1f} ms" if best else "none fits")

    created = not dist.is_initialized()  # in-process probes set up a fake world
    keys = sorted(families)
    # time-optimal probes under "none" first; where a layout does not fit, the other
    # policies and the least-memory ("@lean": weights sharded as far as they go) probes
    first = ("none",) if "none" in recompute else tuple(recompute[:1])
    rest = tuple(m for m in recompute if m not in first) + tuple(
        f"{m}@lean" for m in recompute if m != "selective")
    pool = ProbePool(workers)
    try:
        # each sub-mesh split as its probe arrives, all simulated once all are in (least
        # bound first across sub-meshes: the fewest simulations)
        first_splits: list[Split] = []
        probe(keys, first, on_result=lambda key, res: first_splits.extend(split(key, res)))
        price(first_splits)
        best = best_fit()
        unfit = _UnfitBounds(priced, families, pricer, keys) if rest else None
        bounds = unfit.bounds if unfit else {}
        for key in [k for k in bounds if best is not None
                    and unfit.least(k) >= best.step_time_s]:
            _dominated(priced, bounds.pop(key), best)
        if bounds:
            logger.info("search: %d sub-mesh(es) have layouts that do not fit without "
                        "recomputation and could beat the best that fits: probing recompute "
                        "%s, most promising first", len(bounds), "/".join(rest))
            skipped = []

            def keep(job: tuple) -> bool:  # the best may have improved since
                now = best_fit()
                if now is None or unfit.simulated(job[:2], now.step_time_s) < now.step_time_s:
                    return True
                skipped.append(job[:2])
                return False

            probe(sorted(bounds, key=unfit.least), rest, keep,
                  lambda key, res: price(split(key, res)))
            for key in skipped:
                _dominated(priced, bounds[key], best_fit())
    finally:
        pool.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()
    results = [c for c in priced.values() if not isinstance(c, str)]
    rej = list(rejected) + [(str(lay), c) for lay, c in priced.items() if isinstance(c, str)]
    results.sort(key=lambda c: c.step_time_s)
    flat = [c for c in results if c.layout.pp == 1]
    flat_why = [why for lay, why in priced.items() if lay.pp == 1 and isinstance(why, str)]
    without_pipeline = flat[0] if flat else (flat_why[0] if flat_why else None)
    if max_results is not None:
        results = results[:max_results]
    return SearchReport(
        results=tuple(results), rejected=tuple(rej), world_size=world_size,
        global_batch=global_batch, seq_len=seq_len, profile=prof.name,
        mixed_precision=mixed_precision, n_evaluated=len(layouts), n_submeshes=len(families),
        stage_plans_solved=sum(s.solved for s in pricer.shapes.values()),
        search_s=time.perf_counter() - t0, model=model_meta, memory_reserve=memory_reserve,
        tf32=tf32, options=dataclasses.replace(options, profile=prof.name),
        without_pipeline=without_pipeline, layer_kinds=kinds,
    )


_GATHERING_WORDS = {"once_per_step": "step", "per_block": "block"}

#: The planner's options the search prices layouts under; the others it refuses.
SEARCH_PRICES = ("profile", "mixed_precision", "memory_budget_bytes", "memory_reserve", "tf32",
                 "token_dispatch", "expert_dims", "expert_compute_dtype", "expert_imbalance")


def search_options(options: PlannerOptions | None, old_keywords: dict[str, Any]
                   ) -> PlannerOptions:
    """The options :func:`search` prices with (profile None: "H100"); planner options
    given loose, or ones the search does not price, refused with what to write."""
    refuse_loose("search", old_keywords)
    options = options if options is not None else PlannerOptions()
    if options.recompute != "auto":
        raise ValueError(f"search() chooses each stage's recomputation itself: write "
                         f"recompute=({options.recompute!r},) (the search's choices) instead "
                         f"of options=PlannerOptions(recompute={options.recompute!r})")
    unpriced = [f for f in changed_fields(options) if f not in SEARCH_PRICES]
    if unpriced:
        raise ValueError(f"search() does not price the planner's options {unpriced} (it "
                         f"prices {list(SEARCH_PRICES)}): leave them out of the search's "
                         f"options and plan its chosen layout with them, "
                         f"report.plan(i, options=PlannerOptions(...))")
    if options.profile is None:  # a search stands for a GPU job, as the dry run does
        options = dataclasses.replace(options, profile="H100")
    return options
