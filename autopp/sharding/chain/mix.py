"""The fastest chain of unit plans under a memory budget over the plans already met: a
multiple-choice knapsack along a stage's chain of boundary placements
(:func:`fastest_mix`), what :mod:`autopp.sharding.chain.budget` re-chooses its chain by after each
memory price and after its polish. Exact over the plans given: each position may take any
plan met for its unit on any boundary pair that chains with its neighbours', so identical
blocks may take different plans and pairs where one plan for all cannot use the budget."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autopp.sharding.ilp.solution import SolveResult


def pareto_front(items: Sequence[Any], time_of: Callable[[Any], float],
                 bytes_of: Callable[[Any], float]) -> list[Any]:
    """The items no other item beats on both time and bytes, by bytes."""
    out: list[Any] = []
    for e in sorted(items, key=lambda e: (bytes_of(e), time_of(e))):
        if not out or time_of(e) < time_of(out[-1]) - 1e-15:
            out.append(e)
    return out


_TIME, _BYTES = (lambda r: r.objective_s), (lambda r: r.memory_bytes)
_FIRST, _SECOND = (lambda e: e[0]), (lambda e: e[1])  # a partial sum's (time, bytes, path)


def fastest_mix(kinds: Sequence[int], unit_pairs: Sequence[Mapping[tuple, Any]],
                first_in: Sequence[tuple], last_out: Sequence[tuple],
                seen: Mapping[tuple, Mapping[Any, SolveResult]], budget: float,
                below_s: float, fallback: Sequence[SolveResult],
                fallback_pairs: Sequence[tuple]
                ) -> tuple[list[SolveResult], list[tuple]] | None:
    """(plan, boundary pair) per position of the fastest chain whose counted bytes fit
    ``budget`` and whose time is below ``below_s``; None where none is.

    ``kinds[i]``: the distinct unit at position i; ``unit_pairs[k]``: unit k's boundary
    pairs (input placement, output placement); the first position's input must be in
    ``first_in``, the last one's output in ``last_out``. ``seen[(k, pair)]``: the plans met
    for unit k on that pair. ``fallback`` / ``fallback_pairs``: a chain's plans and pairs,
    offered at their positions where nothing was met for that pair. The Pareto front of
    partial sums (time, bytes) is kept at each boundary placement; partial sums that the
    remaining positions' least bytes would take over the budget, or their least time to
    ``below_s`` or beyond, are dropped."""
    n = len(kinds)
    cands: dict[tuple, list[SolveResult]] = {}
    for i, kind in enumerate(kinds):
        for pair in unit_pairs[kind]:
            if (kind, pair) not in cands:
                cands[kind, pair] = pareto_front(list(seen.get((kind, pair), {}).values()),
                                                 _TIME, _BYTES)
        if not cands.get((kind, fallback_pairs[i])):
            cands[kind, fallback_pairs[i]] = [fallback[i]]
    least_m, least_t = [0.0] * (n + 1), [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        mine = [r for pair in unit_pairs[kinds[i]] for r in cands.get((kinds[i], pair), ())]
        least_m[i] = least_m[i + 1] + min(r.memory_bytes for r in mine)
        least_t[i] = least_t[i + 1] + min(r.objective_s for r in mine)
    # boundary placement -> Pareto front of (time, bytes, path) of the positions so far
    fronts: dict[tuple, list[tuple[float, float, Any]]] = {a: [(0.0, 0.0, None)]
                                                          for a in first_in}
    for i, kind in enumerate(kinds):
        room_m, room_t = budget - least_m[i + 1], below_s - least_t[i + 1]
        grown: dict[tuple, list] = {}
        for pair in unit_pairs[kind]:
            a, b = pair
            if a not in fronts or (i == n - 1 and b not in last_out):
                continue
            into = grown.setdefault(b, [])
            for r in cands[kind, pair]:
                rt, rm = r.objective_s, r.memory_bytes
                into.extend((t + rt, m + rm, (path, r, pair)) for t, m, path in fronts[a]
                            if m + rm <= room_m and t + rt < room_t)
        fronts = {b: pareto_front(entries, _FIRST, _SECOND)
                  for b, entries in grown.items() if entries}
        if not fronts:
            return None
    _, _, path = min((e for front in fronts.values() for e in front), key=lambda e: e[0])
    results: list[SolveResult] = []
    pairs: list[tuple] = []
    while path is not None:
        path, r, pair = path
        results.append(r)
        pairs.append(pair)
    return results[::-1], pairs[::-1]
