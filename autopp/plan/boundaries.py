"""Which placement each stage boundary takes: the activation's kinds between stages
(:data:`BOUNDARIES`), those worth comparing on a sub-mesh, and the choice of one per
boundary by Alpa's pipeline objective (:func:`choose_boundaries`). The stage times and
transfer times it compares come from the maker (:func:`autopp.plan.make.plan_boundaries`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from autopp.plan.objective import pipeline_objective_s


#: Placements (over dp, tp) an activation may have between two stages: the batch split over
#: dp and whole over tp, or also its sequence split over tp (1/tp of the bytes to send).
#: "vocab" is the last stage's output only: logits split on the vocabulary over tp, for a
#: loss computed in parallel (loss parallel).
BOUNDARIES: dict[str, tuple[str, str]] = {
    "batch": ("S(0)", "R"), "batch+seq": ("S(0)", "S(1)"), "vocab": ("S(0)", "S(2)"),
}


def boundary_kinds(sub_mesh: DeviceMesh) -> tuple[str, ...]:
    """The boundary placements worth comparing on ``sub_mesh`` (one when tp is 1)."""
    return ("batch", "batch+seq") if sub_mesh["tp"].size() > 1 else ("batch",)


_EXHAUSTIVE = 4096
"""Up to this many boundary assignments, :func:`choose_boundaries` scores them all (exact for
any stage-to-rank placement); beyond it, the capped dynamic program."""


def choose_boundaries(
    n_stages: int, kinds: Sequence[str], stage_time: Any, send_time: Any,
    last_kinds: Sequence[str] = ("batch",), n_microbatches: int = 1,
    rank_of: Sequence[int] | None = None,
) -> list[str]:
    """Placement of every stage boundary, minimising Alpa's pipeline objective

        Σ_s (t_s + transfers_s) + (M − 1) · max over pp ranks of Σ_{s on the rank} t_s

    where ``t_s = stage_time(s, kind_in, kind_out)`` and ``send_time(s, kind)`` (seconds per
    microbatch; each boundary is sent forward and its gradient back) and ``M`` is
    ``n_microbatches``. The first stage's input is "batch", the last stage's output one of
    ``last_kinds`` (its ``stage_time`` includes the loss). A dynamic program over the chain
    of boundaries minimises the sum under a cap on every stage's time; trying each stage time
    as the cap and scoring each result with the full objective is exact with one stage per
    pp rank (``rank_of[s]``, default ``s``). Up to :data:`_EXHAUSTIVE` assignments (e.g. 8
    stages with two boundary kinds: 256) every one is scored, which is exact for any
    placement of stages on ranks. Returns ``n_stages + 1`` kinds: into stage 0,
    between the stages, out of the last stage.
    """
    memo: dict[tuple, float] = {}

    def t(s: int, a: str, b: str) -> float:
        if (s, a, b) not in memo:
            memo[s, a, b] = stage_time(s, a, b)
        return memo[s, a, b]

    def outs(s: int) -> Sequence[str]:
        return last_kinds if s == n_stages - 1 else kinds

    def sum_dp(cap: float) -> list[str] | None:
        # best[k] = (cost of stages < s with boundary into s of kind k, choices so far)
        best: dict[str, tuple[float, list[str]]] = {"batch": (0.0, ["batch"])}
        for s in range(n_stages):
            last = s == n_stages - 1
            nxt: dict[str, tuple[float, list[str]]] = {}
            for k_out in outs(s):
                cands = [
                    (cost + t(s, k_in, k_out) + (0.0 if last else send_time(s, k_out)),
                     chosen + [k_out])
                    for k_in, (cost, chosen) in best.items() if t(s, k_in, k_out) <= cap
                ]
                if cands:
                    nxt[k_out] = min(cands, key=lambda c: c[0])
            best = nxt
            if not best:
                return None
        return min(best.values(), key=lambda c: c[0])[1]

    ranks = list(rank_of) if rank_of is not None else list(range(n_stages))

    def objective(bounds: list[str]) -> float:
        ts = [t(s, bounds[s], bounds[s + 1]) for s in range(n_stages)]
        sends = sum(send_time(s, bounds[s + 1]) for s in range(n_stages - 1))
        return pipeline_objective_s(ts, n_microbatches, ranks, sends)

    n_choices = len(kinds) ** (n_stages - 1) * len(last_kinds)
    if n_microbatches > 1 and n_choices <= _EXHAUSTIVE:  # small: try every assignment
        return min(
            (["batch", *mid, last] for mid in itertools.product(kinds, repeat=n_stages - 1)
             for last in last_kinds),
            key=objective,
        )
    candidates = [sum_dp(math.inf)]
    if n_microbatches > 1:
        caps = sorted({t(s, a, b) for s in range(n_stages) for a in (kinds if s else ["batch"])
                       for b in outs(s)})
        candidates += [sum_dp(cap) for cap in caps]
    return min((c for c in candidates if c is not None), key=objective)
