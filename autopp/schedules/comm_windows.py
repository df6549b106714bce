"""How long a schedule lets each stage's once-per-step collectives run beside compute.

With collectives issued ahead (``StageCost.collectives_ahead``), a stage's UNSHARD gathers run
on its rank's communication stream from the step's start until the stage's first action
needs them, and its REDUCE_GRAD reductions from its last backward until the step ends. What
fits its window costs the step nothing; the excess delays the stage or the step's end.

:func:`collective_windows` reads those windows off a simulated step whose stages have no
such collectives (their times are what the planner is about to choose), so every window is
the schedule's own. A rank's stages share its one communication stream, so each gets an equal
share of the rank's shortest window: their collectives then fit together in any order. The
sharding planner prices against them (:mod:`autopp.sharding.chain.once_per_step`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopp.schedules.sim_result import COMM_KINDS, COMPUTE_KINDS, SimulationResult


def collective_windows(sim: SimulationResult) -> list[tuple[float, float]]:
    """Per stage, (seconds its UNSHARD can run before the stage's first action, seconds
    its REDUCE_GRAD can run before the step ends), from ``sim``: a step simulated with the
    stages' collectives issued ahead and priced at zero. A stage whose list has no UNSHARD
    (or no REDUCE_GRAD) gets no window for it."""
    stage_rank = sim.actions.stage_to_rank
    n = len(stage_rank)
    end = max((e.end_s for e in sim.events if e.kind in COMPUTE_KINDS | COMM_KINDS),
              default=0.0)
    first = [float("inf")] * n
    unshard: list[float | None] = [None] * n
    reduce: list[float | None] = [None] * n
    for e in sim.events:
        if e.kind in COMPUTE_KINDS:
            first[e.stage] = min(first[e.stage], e.start_s)
        elif e.kind == "UNSHARD":
            unshard[e.stage] = e.start_s if unshard[e.stage] is None else min(
                unshard[e.stage], e.start_s)
        elif e.kind == "REDUCE_GRAD":
            reduce[e.stage] = e.start_s if reduce[e.stage] is None else max(
                reduce[e.stage], e.start_s)
    out = [(0.0, 0.0)] * n
    for r in set(stage_rank):
        mine = [s for s in range(n) if stage_rank[s] == r]
        gather = (min(first[s] for s in mine) - min(unshard[s] for s in mine)
                  if all(unshard[s] is not None for s in mine) else 0.0)
        reduction = (end - max(reduce[s] for s in mine)
                     if all(reduce[s] is not None for s in mine) else 0.0)
        share = (max(0.0, gather) / len(mine), max(0.0, reduction) / len(mine))
        for s in mine:
            out[s] = share
    return out


def schedule_windows(schedule: str, per_microbatch_s: Sequence[float], *, pp: int,
                     n_microbatches: int, stage_ranks: Sequence[int],
                     send_bytes: Sequence[int], link, links: Mapping | None = None
                     ) -> list[tuple[float, float]]:
    """:func:`collective_windows` of ``schedule`` over stages that take ``per_microbatch_s``
    each (forward and backward, without their once-per-step collectives; split in thirds,
    :meth:`StageCost.thirds`), each sending ``send_bytes`` a microbatch over ``link``
    (``links``: per pair of pp ranks). The stage placement must be ``stage_ranks``."""
    from autopp.schedules.simulate import StageCost, simulate_schedule

    costs = []
    for t, nbytes in zip(per_microbatch_s, send_bytes):
        f, i, w = StageCost.thirds(t)
        costs.append(StageCost(forward_s=f, backward_input_s=i, backward_weight_s=w,
                               collectives_ahead=True, p2p_bytes_per_microbatch=nbytes))
    sim = simulate_schedule(schedule, costs, pp=pp, n_microbatches=n_microbatches,
                            n_stages=len(costs), link=link, links=links)
    return collective_windows(sim.check_placement(stage_ranks))
