"""Probing sub-meshes for the configuration search, on worker processes.

A probe job plans the probe stages of one (dp, tp) sub-mesh
(:func:`~autopp.layout_search.unit_costs.probe_costs`) on the fake process group. Jobs run
on forked worker processes (:class:`ProbePool`) that keep the planner's in-process memo of
traced units and ILP models between jobs: a sub-mesh probed again under other
recomputation policies goes back to the worker that traced it.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from autopp.layout_search.unit_costs import ShapeCosts, probe_costs

__all__ = ["JOB", "PROBE_BUG", "ProbePool"]

logger = logging.getLogger(__name__)

PROBE_BUG = "an error in autopp while probing (a bug, not a property of the layout): "
"""How a probe failure that is not one of the planner's refusals (a ValueError) begins."""

JOB: dict[str, Any] = {}
"""What probe jobs read: set before the worker processes are forked (they inherit it)."""


def probe_job(dp: int, tp: int, pp: int, m_ref: int, modes: tuple[str, ...]
               ) -> ShapeCosts | str:
    """Probe one sub-mesh (in a worker process or this one): its costs, or why not."""
    from autopp.mesh import build_world_mesh, init_fake_world, stage_sub_mesh

    from autopp import tracing

    j = JOB
    if not dist.is_initialized():
        init_fake_world(j["world"])
    try:
        sub = stage_sub_mesh(build_world_mesh(pp=pp, dp=dp, tp=tp, device_type="cpu"))
        tokens = torch.empty((j["global_batch"] // dp, j["seq_len"]), dtype=torch.long,
                             device="meta")
        with tracing.settings(j.get("trace_settings", {})):  # e.g. MoE dispatch, imbalance
            return probe_costs(j["model"], j["layout"], sub, tokens=tokens,
                               n_microbatches=m_ref, profile=j["profile"],
                               boundary="batch+seq" if tp > 1 else "batch",
                               loss_kind="vocab" if tp > 1 else "batch", modes=modes,
                               mixed_precision=j["mp"], tf32=j["tf32"], kinds=j.get("kinds"))
    except ValueError as e:  # the planner's own refusals (InfeasiblePlanError among them)
        return f"the planner could not plan this sub-mesh: {e}".split("\n")[0]
    except Exception as e:  # noqa: BLE001 - anything else is a bug in autopp, said so
        why = f"{type(e).__name__}: {e}".split("\n")[0]
        if os.environ.get("AUTOPP_TRACEBACK"):
            logger.warning("probing dp=%d tp=%d failed:\n%s", dp, tp, traceback.format_exc())
        else:
            logger.warning("probing dp=%d tp=%d failed (%s); AUTOPP_TRACEBACK=1 logs the "
                           "traceback", dp, tp, why)
        return f"{PROBE_BUG}{why}"


def _probe_worker(jobs: Any, results: Any, wid: int) -> None:
    """A probe process: runs jobs until it reads None. It keeps its traced units and ILP
    models (the planner's in-process memo) between jobs, so a sub-mesh probed again under
    other recomputation policies is not traced again."""
    while (job := jobs.get()) is not None:
        results.put((wid, job, probe_job(*job)))


class ProbePool:
    """Probe jobs on forked worker processes (or in this process when ``workers`` <= 1).

    A sub-mesh probed again goes back to the worker that probed it (its traces are there)
    unless another worker is idle with nothing of its own to do."""

    def __init__(self, workers: int):
        self.n = workers
        self.home: dict[tuple[int, int], int] = {}
        self.procs: list[Any] = []
        if workers > 1:
            import multiprocessing

            ctx = multiprocessing.get_context("fork")
            self.results = ctx.Queue()
            self.queues = [ctx.Queue() for _ in range(workers)]
            self.procs = [ctx.Process(target=_probe_worker, args=(q, self.results, w),
                                      daemon=True) for w, q in enumerate(self.queues)]
            for proc in self.procs:
                proc.start()

    def run(self, jobs: list[tuple], done: Any, keep: Any = None
            ) -> dict[tuple, ShapeCosts | str]:
        """Results by job, in ``jobs`` order where workers are free; ``done(job, result)``
        as each arrives (once the worker that sent it has its next job); ``keep(job)``, asked
        as a job is about to start: False skips it (no result)."""
        keep = keep or (lambda job: True)
        if not self.procs:
            out = {}
            for job in jobs:
                if keep(job):
                    out[job] = probe_job(*job)
                    done(job, out[job])
            return out
        import queue

        own: list[list[tuple]] = [[] for _ in range(self.n)]
        free: list[tuple] = []
        for job in jobs:
            w = self.home.get(job[:2])
            (own[w] if w is not None else free).append(job)
        got: dict[tuple, ShapeCosts | str] = {}
        idle = list(range(self.n))

        def give(w: int) -> None:
            while (mine := own[w] or free or max(own, key=len)):
                job = mine.pop(0)
                if keep(job):
                    self.home[job[:2]] = w
                    self.queues[w].put(job)
                    idle.remove(w)
                    return

        for w in list(idle):
            give(w)
        while len(idle) < self.n:
            try:
                w, job, res = self.results.get(timeout=5.0)
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"search: probe worker process(es) {dead} died "
                                       "(out of memory?); retry with workers=1") from None
                continue
            got[job] = res
            idle.append(w)
            give(w)  # the worker goes on while this process reads its result
            done(job, res)
        return got

    def close(self) -> None:
        for q in getattr(self, "queues", []):
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
