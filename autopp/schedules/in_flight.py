"""How many microbatches a pipeline stage holds at once, read off a schedule's action lists
alone (no times): the most whose activations are held (:func:`max_in_flight`, the ILP's
activation factor) and, with a split backward, the (F->I, I->W) counts at each of the
stage's memory peaks (:func:`split_in_flight`, the ILP's peak rows). Both hold at any stage
times: a stage's steps run in its rank's list order (``tests/schedules/test_simulator.py`` checks
them against :func:`autopp.schedules.simulate.simulate`'s event-time memory)."""

from __future__ import annotations

from collections.abc import Sequence

from autopp._compat import pipelining as _torch_compat


def max_in_flight(compute: Sequence[Sequence[str | None]], n_stages: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations are held at once: forwards run
    less backwards done (B, or W after I: a split backward keeps activations until W).

    ``compute``: each rank's compute steps as torch's action strings (None idle), e.g.
    :attr:`ScheduleActions.compute` or :func:`~autopp.schedules.actions.compute_order`. A
    stage's steps run in its rank's list order, so this is what :func:`simulate` reports as
    ``max_in_flight`` (when I keeps activations for W) at any stage times."""
    count = [0] * n_stages
    best = [0] * n_stages
    for row in compute:
        for text in row:
            if text is None:
                continue
            for s, kind, _ in _torch_compat.action_parts(text):
                if kind == "F":
                    count[s] += 1
                    best[s] = max(best[s], count[s])
                elif kind in ("B", "W"):
                    count[s] -= 1
    return tuple(best)


def split_in_flight(compute: Sequence[Sequence[str | None]], n_stages: int
                    ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, what a split backward holds at its memory peaks: the (microbatches between
    their F and their I, microbatches between their I and their W) pairs that can be the
    largest of ``a × activations + b × what W keeps`` for some sizes of the two (the upper
    convex hull of the pairs the lists reach, by ``a`` descending); empty for a stage whose
    backwards are all whole (B). The peak of such a stage is the largest of those sums over
    its pairs, which no one count times one size gives: a zero-bubble stage holds up to
    ``max_in_flight`` microbatches' activations early in the step and, later, the W inputs of
    nearly as many.

    ``compute``: as :func:`max_in_flight`."""
    held = [[0, 0] for _ in range(n_stages)]
    seen: list[set[tuple[int, int]]] = [set() for _ in range(n_stages)]
    split = [False] * n_stages
    for row in compute:
        for text in row:
            if text is None:
                continue
            for s, kind, _ in _torch_compat.action_parts(text):
                h = held[s]
                if kind == "F":
                    h[0] += 1
                elif kind == "B":
                    h[0] -= 1
                elif kind == "I":
                    h[0], h[1], split[s] = h[0] - 1, h[1] + 1, True
                elif kind == "W":
                    h[1] -= 1
                seen[s].add((h[0], h[1]))
    return tuple(_upper_hull(seen[s]) if split[s] else () for s in range(n_stages))


def _upper_hull(points: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The points of ``points`` (non-negative) that maximise ``a·x + b·y`` for some
    ``x, y >= 0``: the upper-right convex hull's vertices, by ``a`` descending."""
    pts = sorted(points, key=lambda p: (-p[0], -p[1]))
    front: list[tuple[int, int]] = []
    for p in pts:  # the Pareto front: a descending, b rising
        if not front or p[1] > front[-1][1]:
            front.append(p)
    hull: list[tuple[int, int]] = []
    for p in front:
        while len(hull) >= 2:
            (a0, b0), (a1, b1) = hull[-2], hull[-1]
            # hull[-1] is kept only above the segment hull[-2] -> p
            if (a1 - a0) * (p[1] - b0) - (b1 - b0) * (p[0] - a0) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    return tuple(hull)
