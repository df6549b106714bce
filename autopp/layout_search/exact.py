"""The search's best layout planned exactly, falling back to the next-ranked ones.

What: :func:`plan_ranked` plans the ranked layouts of a :class:`SearchReport` exactly
(:meth:`SearchReport.plan`: every stage under the device's memory, simulated), best first,
until one has a plan whose simulated peaks fit. Why: the search ranks layouts from probe
costs, and the planner's count of what a split backward keeps from I to W is an estimate, so
the best layout's exact plan may not fit, or not plan at all under its budgets. Invariant:
:attr:`ExactPlan.skipped` says why each layout before the one returned was passed over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from autopp.layout_search.search import SearchReport

TRIES = 3
"""The best-ranked layouts planned exactly, in order, until one fits."""


@dataclass(frozen=True, kw_only=True)
class ExactPlan:
    """What :func:`plan_ranked` planned."""

    report: Any
    """The :class:`~autopp.dry_run.DryRunReport` of the layout planned (``report.plan`` is
    the plan to save); None when none of the tried layouts has an exact plan."""
    rank: int
    """Its index in the search's ranking (0: the best)."""
    skipped: tuple[str, ...]
    """Why each layout tried before it was passed over."""
    over: tuple[int, ...]
    """pp ranks over the usable memory at their simulated peak (empty: it fits); only when
    no tried layout fits, the last one tried is returned with them."""


def plan_ranked(search: SearchReport, *, tries: int = TRIES,
                trace: str | os.PathLike | None = None,
                timeline: str | os.PathLike | None = None,
                options: Any = None) -> ExactPlan:
    """Plan the ranked layouts exactly until one fits (see the module docstring), with the
    planner's ``options`` (None: those the search priced with)."""
    from autopp.sharding import InfeasiblePlanError

    if not search.results:
        raise ValueError(search.no_fit_message())
    exact, rank, over = None, 0, ()
    skipped: list[str] = []
    for k, cand in enumerate(search.results[:tries]):
        try:
            planned = search.plan(k, options=options, trace=trace, timeline=timeline)
        except InfeasiblePlanError as e:
            skipped.append(f"layout {k + 1} ({cand.layout}) has no exact plan that fits: "
                           f"{str(e).splitlines()[0]}")
            continue
        exact, rank = planned, k
        over = tuple(r for r, ok in enumerate(planned.fits()) if not ok)
        if not over:
            break
        skipped.append(f"layout {k + 1} ({cand.layout}), planned exactly, is over the usable "
                       f"memory on pp ranks {list(over)} at their simulated peak ("
                       f"{', '.join(f'{p / 2**30:.1f}' for p in planned.peak_bytes())} GiB "
                       f"against {planned.usable_bytes / 2**30:.2f})")
    return ExactPlan(report=exact, rank=rank, skipped=tuple(skipped), over=over)
