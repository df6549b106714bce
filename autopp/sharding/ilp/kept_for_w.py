r"""What a split backward keeps from I to W, for the sharding ILP's memory row
(:mod:`autopp.sharding.ilp.memory_row`): which values, their bytes under a choice, and the
rows that hold a stage's peak.

A split backward frees a microbatch's activations :math:`A` at the end of its I and keeps
what W reads, :math:`K`, until its W. With :math:`a` microbatches between F and I and
:math:`b` between I and W, a stage holds :math:`aA + bK`; its peak is the largest over the
schedule's pairs (:func:`autopp.schedules.in_flight.split_in_flight`). In the ILP: columns
for one microbatch's :math:`A(x)` and :math:`K(x)` (MiB), a column :math:`h` in their place,
and one row :math:`h - aA - bK \ge 0` per pair, padded to :data:`PEAK_ROWS` so every stage's
LP has one structure (:func:`peak_coefs` re-sets a warm LP). Invariant: :math:`h` sits at the
largest, exact for a unit; a stage's summed units bound its peak from above."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import fx

from autopp.sharding.options.strategies import Option, tensor_vals

if TYPE_CHECKING:
    from autopp.sharding.ilp.memory_row import MemoryRow, Terms

PEAK_ROWS = 4
"""Peak rows every split-backward accounting has (its peaks, the last repeated): the most
any named schedule's stage needs is 3 (ZBVZeroBubble, DualPipeV), so every stage's LP has
one structure and the solver re-sets only the peaks' coefficients between stages."""


def held_bytes(activation_factor: float | None, split_in_flight: Sequence[tuple[float, float]],
               activation_bytes: Any, kept_for_w_bytes: Any) -> Any:
    """What a stage's microbatches in flight hold at its peak (bytes, or arrays of them):
    the largest over the ``split_in_flight`` peaks of ``a`` × activations + ``b`` × what W
    keeps, or ``activation_factor`` × activations where the backward is whole
    (:class:`~autopp.sharding.ilp.memory_row.MemorySpec`). The one rule for the ILP's row, its
    accounting and the layout search's pricing."""
    if split_in_flight:
        return functools.reduce(np.maximum, [a * activation_bytes + b * kept_for_w_bytes
                                             for a, b in split_in_flight])
    return (activation_factor or 0.0) * activation_bytes


def padded(peaks: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``peaks`` with the last repeated up to :data:`PEAK_ROWS`."""
    peaks = list(peaks)
    return peaks + [peaks[-1]] * (PEAK_ROWS - len(peaks))


def reads(row: MemoryRow) -> dict[tuple[fx.Node, int], None]:
    """What a split backward keeps from I to W, as the edges (reader, argument index)
    that read it: the weight-gradient nodes' (reached from the parameter gradients, not
    from the input gradients nor the forward) reads of values they do not make, parameters
    and parameter-only values aside. Where such a value is an output of a multi-output
    backward op the input gradient needs too (a fused norm backward's weight gradient),
    that op's reads stand in for it: the lowered graphs split it, and W makes that output
    from them. Each edge counts in its producer's placement (:func:`edge_bytes`). Checked
    against the lowered W graphs' inputs by tests/sharding/test_memory_ilp.py (within 12%:
    the split places a few recomputed values and views on the other side); whole stages by
    benchmarks/split_backward_memory.py."""
    hit = row._structure.get("kept_for_w")
    if hit is not None:
        return hit
    from autopp.graph.walk import closure

    j, nodes = row.st.joint, row.st.nodes
    fwd = closure(list(j.outputs.values()))
    w_only = closure(list(j.grads.values())) - closure(list(j.input_grads.values())) - fwd
    state = row._param_only | set(j.params.values()) | set(j.buffers.values())
    out: dict[tuple[fx.Node, int], None] = {}
    for n in j.gm.graph.nodes:
        if n not in w_only or n not in nodes:
            continue
        for i, (src, k) in enumerate(nodes[n].edges):
            if src in w_only or src in state or src not in row.options:
                continue
            if src not in fwd and len(tensor_vals(src)) > 1:
                out.update(dict.fromkeys(
                    (src, i2) for i2, e in enumerate(nodes[src].edges)
                    if e[0] not in state and e[0] in row.options))
            else:
                out[n, i] = None
    row._structure["kept_for_w"] = out
    return out


def edge_bytes(row: MemoryRow, val: Any, a: Any) -> float:
    """A kept read's bytes: the value in its producer's placement ``a``, which is what W
    receives from I. A redistribution to the reader's placement that only W needs (a
    gather of an activation over dp for a weight gradient) runs in W, since W runs the
    collectives only it needs (``_compat.graph.split_di_dw_graph``); its result is W's
    working memory, which the lowered graphs' estimate counts (``work``), not a value
    held from I to W."""
    return row.costs.local_bytes(val, a)


def add_terms(row: MemoryRow, t: Terms, mib: float) -> None:
    """``t.kept`` (bytes per column) and the two columns equal to one microbatch's
    activations and kept bytes (in ``mib``), each with its defining row."""
    for d, i in reads(row):
        src, k = row.st.nodes[d].edges[i]
        val = tensor_vals(src)[k]
        for c, a, _ in row.edge_cols.get((d, i), ()):
            t.kept[c] = t.kept.get(c, 0.0) + edge_bytes(row, val, a)
    for name, terms in (("act_col", t.act), ("kept_col", t.kept)):
        col = t.col()
        setattr(t, name, col)
        t.row([(col, 1.0)] + [(c, -v / mib) for c, v in terms.items()], 0.0, 0.0)


def add_peak_rows(t: Terms, peaks: Sequence[tuple[float, float]]) -> None:
    """The held column and its :data:`PEAK_ROWS` rows ``held - a·act - b·kept >= 0``."""
    t.held = t.col()
    for a, b in padded(peaks):
        t.peak_rows.append(len(t.rows))
        t.row([(t.held, 1.0), (t.act_col, -a), (t.kept_col, -b)], 0.0)


def peak_coefs(t: Terms, peaks: Sequence[tuple[float, float]], first_row: int
               ) -> tuple[tuple[int, int, float], ...]:
    """The (LP row, column, value) entries of ``t``'s peak rows that differ between
    accountings (``-a`` and ``-b`` of each peak), the rows counted from ``first_row`` (the
    model's own rows come first): a warm LP built for other peaks is re-set to these
    (:class:`autopp.sharding.ilp.highs.WarmLps`)."""
    if t.held is None:
        return ()
    return tuple(e for r, (a, b) in zip(t.peak_rows, padded(peaks))
                 for e in ((first_row + r, t.act_col, -a), (first_row + r, t.kept_col, -b)))


def held_at(t: Terms, x: np.ndarray, peaks: Sequence[tuple[float, float]], mib: float
            ) -> float:
    """The held column's least value its rows allow at the LP point ``x`` (MiB)."""
    act = sum(v * x[c] for c, v in t.act.items())
    kept = sum(v * x[c] for c, v in t.kept.items())
    return held_bytes(None, peaks, act, kept) / mib


def kept_bytes(row: MemoryRow, choice: Mapping[fx.Node, Option]) -> float:
    """One microbatch's kept bytes under a full choice (the accounting of ``t.kept``)."""
    total = 0.0
    for d, i in reads(row):
        src, k = row.st.nodes[d].edges[i]
        if src in choice and d in choice:
            total += edge_bytes(row, tensor_vals(src)[k], choice[src].out[k])
    return total
