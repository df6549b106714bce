r"""The sharding ILP's per-device memory row and recomputation costs (:class:`MemoryRow`, built
once per recomputation policy), and :meth:`MemoryRow.account`, the same count walked exactly on
a chosen plan, which is what plans report. The row (:class:`MemorySpec`), each family built by:

    State + f · Act + Gath ≤ M       (with a split backward: State + h + Gath ≤ M)
    State  parameters, optimizer state, gradients G_p ≥ both their sizes   _state_terms
    Act    what the backward reads under the policy; Recomp in the objective  _activation_terms
    Gath   parameter-only values others read, once per (value, placement)  _gathered_terms
    h ≥ a·A + b·K per (F→I, I→W) in-flight pair, K what W keeps from I   _kept_terms,
           padded to PEAK_ROWS so every stage's LP has one structure       _add_peak_rows

A reduction is never re-run, so its output is counted where a recomputed node reads it. Every
row is in MiB (:data:`MIB`), which keeps coefficients within a few orders of magnitude;
:class:`Terms` holds bytes per unit of each column. Invariant: with integral choices the row
equals ``account`` up to cuts deeper than one edge; ``h`` sits at the largest peak."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import fx

from autopp.graph.walk import is_view
from autopp.sharding.options.strategies import Option, tensor_vals

if TYPE_CHECKING:
    from autopp.sharding.ilp.solver import Model


MIB = float(2**20)
"""The unit of the solver's memory row and of the gradient columns :math:`G_p` (module
docstring): every row of the LP is then in MiB or unit-free (the :math:`W` rows' ±1)."""

Recompute = str
"""A recomputation policy: ``"none"``, ``"selective"`` or ``"full"`` (see
:mod:`autopp.graph.recompute`)."""

PEAK_ROWS = 4
"""Peak rows every split-backward accounting has (its peaks, the last repeated): the most
any named schedule's stage needs is 3 (ZBVZeroBubble, DualPipeV), so every stage's LP has
one structure and the solver re-sets only the peaks' coefficients between stages."""


def held_bytes(activation_factor: float | None, split_in_flight: Sequence[tuple[float, float]],
               activation_bytes: Any, kept_for_w_bytes: Any) -> Any:
    """What a stage's microbatches in flight hold at its peak (bytes, or arrays of them):
    the largest over the ``split_in_flight`` peaks of ``a`` × activations + ``b`` × what W
    keeps, or ``activation_factor`` × activations where the backward is whole
    (:class:`MemorySpec`). The one rule for the ILP's row, its accounting and the layout
    search's pricing."""
    if split_in_flight:
        return functools.reduce(np.maximum, [a * activation_bytes + b * kept_for_w_bytes
                                             for a, b in split_in_flight])
    return (activation_factor or 0.0) * activation_bytes


def _padded(peaks: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``peaks`` with the last repeated up to :data:`PEAK_ROWS`."""
    peaks = list(peaks)
    return peaks + [peaks[-1]] * (PEAK_ROWS - len(peaks))


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """What the per-device memory row counts (this module's docstring)."""

    optimizer_state_factor: float | None = None
    """Explicit state categories: optimizer state bytes per parameter byte, sharded like the
    parameter (AdamW with fp32 parameters: 2.0), plus the parameters and their gradients
    (at the larger of the reduced and the unreduced size). None: parameter bytes alone."""
    activation_factor: float | None = None
    """Microbatches in flight on the stage: activations count this many times and gathered
    parameters once. None: neither is counted (the legacy parameter-only row)."""
    largest_tensor_bytes: float | None = None
    """A bound on every tensor the stage makes while it runs and frees within an action
    (an op's output, a redistributed value: ``Model.col_bytes``), not a term of the row:
    choices that make a larger one are excluded (where no plan remains, the solve drops the
    bound and its status says so). The row counts what stays (state, activations, gathered
    weights); a backward that gathers a whole vocabulary's logits gradient over dp would
    stay invisible to it. None: no bound."""
    split_in_flight: tuple[tuple[float, float], ...] = ()
    """With a split backward (zero bubble, DualPipeV): the stage's (microbatches between
    their F and their I, microbatches between their I and their W) at each of its memory
    peaks (:func:`autopp.schedules.in_flight.split_in_flight`). The row then holds the
    largest over them of ``a`` × activations + ``b`` × what W keeps (:meth:`held_bytes`) in
    place of :attr:`activation_factor` × activations, which stays set (the most microbatches
    in flight) to say that activations count. Empty: a backward is whole, activations are
    held from F to its end."""
    gathered_share: float = 1.0
    """The share of the gathered weights held at once: 1 gathered once per step; with
    weights gathered block by block, (prefetch + 1) / the stage's blocks
    (:mod:`autopp.graph.weight_gathering`: a few blocks' copies at a time)."""
    gradients_reduced: bool = False
    """Whether gradients are held reduced (block by block: each microbatch's are
    reduce-scattered as they are made), not at the larger of the reduced and the unreduced
    size (the once-per-step accumulator)."""
    gradient_copies: float = 1.0
    """How many gradient-sized tensors the explicit state holds per parameter at the
    step's peak: 1 (the accumulator) for a step of one microbatch, 2 where later
    microbatches' backwards each return fresh gradients that exist next to the accumulator
    they are added to (torch's graph runtime adds them after the backward's graph returns)."""

    @property
    def counts_activations(self) -> bool:
        return self.activation_factor is not None

    @property
    def splits(self) -> bool:
        """Whether some peak holds what W keeps (a pair with ``b > 0``): the row then needs
        its peak rows. Peaks of ``(a, 0)`` alone (the layout search's probes: the plain
        row, what W keeps counted beside it) weigh the activations by the largest ``a``."""
        return any(b > 0 for _, b in self.split_in_flight)

    @property
    def row_factor(self) -> float | None:
        """The activations' weight in a row without peak rows."""
        if self.split_in_flight and not self.splits:
            return max(a for a, _ in self.split_in_flight)
        return self.activation_factor

    def held_bytes(self, activation_bytes: float, kept_for_w_bytes: float) -> float:
        """Per device, what the stage's microbatches in flight hold at its peak, from one
        microbatch's activations and (split backward) what its W keeps from I."""
        return float(held_bytes(self.activation_factor, self.split_in_flight,
                                activation_bytes, kept_for_w_bytes))


@dataclass(frozen=True, slots=True)
class MemoryAccount:
    """Per-device bytes of one choice (:meth:`MemoryRow.account`)."""

    state_bytes: float
    """Parameters and their state as :class:`MemorySpec` counts them."""
    activation_bytes: float
    """Saved for the backward by one microbatch (before the activation factor)."""
    gathered_bytes: float
    """Parameter-only values other nodes read (gathered / cast weights), once per step."""
    recompute_s: float
    """Compute time of the forward nodes the backward recomputes (one microbatch)."""
    counted_bytes: float
    """What the memory row counts: state + the activations held
    (:meth:`MemorySpec.held_bytes`) + gathered (or the state alone without an activation
    factor)."""
    kept_for_w_bytes: float = 0.0
    """What a split backward keeps from one microbatch's I to its W (only counted with
    :attr:`MemorySpec.split_in_flight`; else 0)."""


@dataclass(slots=True)
class Terms:
    """The memory row and recomputation costs of one policy: extra (continuous) columns
    after the model's own, rows over both, and per-column coefficients."""

    first_col: int
    upper: list[float] = field(default_factory=list)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)
    state: dict[int, float] = field(default_factory=dict)
    act: dict[int, float] = field(default_factory=dict)
    kept: dict[int, float] = field(default_factory=dict)
    """Bytes a split backward keeps from I to W per column (one microbatch)."""
    held: int | None = None
    """The column (MiB) that bounds the activations held at the stage's peak from above,
    one row per :attr:`MemorySpec.split_in_flight` pair over :attr:`act_col` and
    :attr:`kept_col`; None: the row weighs :attr:`act` by the activation factor itself."""
    act_col: int | None = None
    kept_col: int | None = None
    """Columns (MiB) equal to one microbatch's activations and what W keeps: the peak rows
    read them, three coefficients each, so the rows' structure is the same for every
    stage's peaks (:data:`PEAK_ROWS`) and one LP serves them all (:meth:`peak_coefs`)."""
    peak_rows: list[int] = field(default_factory=list)
    """Indices in :attr:`rows` of the peak rows (``held - a·act - b·kept >= 0``)."""
    gathered: dict[int, float] = field(default_factory=dict)
    rtime: dict[int, float] = field(default_factory=dict)
    """Seconds of recomputation per column (objective)."""
    lp: Any = None
    """The solver's LP over the model's columns and these, built once
    (:meth:`autopp.sharding.ilp.solver.Model.solve`)."""
    row_upper: Any = None
    """That LP's row upper bounds; the last is the memory row's (the budget)."""
    arrays: dict[str, Any] = field(default_factory=dict)
    """The solver's per-column arrays of these terms, made on first use (the terms do not
    change once built: :meth:`autopp.sharding.ilp.solver.Model.solve` reads them every solve)."""

    def col(self, upper: float = np.inf) -> int:
        self.upper.append(upper)
        return self.first_col + len(self.upper) - 1

    def row(self, coefs: Mapping[int, float] | list[tuple[int, float]], lo: float,
            hi: float = np.inf) -> None:
        items = coefs.items() if isinstance(coefs, Mapping) else coefs
        merged: dict[int, float] = {}
        for c, v in items:
            merged[c] = merged.get(c, 0.0) + v
        self.rows.append((list(merged), list(merged.values()), lo, hi))


def _add(d: dict[int, float], col: int, v: float) -> None:
    d[col] = d.get(col, 0.0) + v


def _add_peak_rows(t: Terms, peaks: Sequence[tuple[float, float]]) -> None:
    """The held column and its :data:`PEAK_ROWS` rows ``held - a·act - b·kept >= 0``."""
    t.held = t.col()
    for a, b in _padded(peaks):
        t.peak_rows.append(len(t.rows))
        t.row([(t.held, 1.0), (t.act_col, -a), (t.kept_col, -b)], 0.0)


class MemoryRow:
    """The memory row and recomputation costs of one :class:`~autopp.sharding.ilp.solver.Model`,
    per recomputation policy (:meth:`terms`), and the exact count of a chosen plan
    (:meth:`account`). Reads the model's option columns, edge columns and cost model; its
    own columns come after the model's. ``param_only``: the model's parameter-only values;
    ``shared``: what does not depend on the activation factor, shared by the model's
    ``with_memory`` copies (the recomputation structure per policy, and the terms per
    policy and accounting with the factor left out)."""

    def __init__(self, model: Model, param_only: set[fx.Node], shared: dict[str, dict]):
        self._model = model
        self.st, self.costs, self.memory = model.st, model.costs, model.memory
        self.options, self.col0, self.edge_cols = model.options, model.col0, model.edge_cols
        self.param_bytes = model.param_bytes
        self._param_only = param_only
        self._terms: dict[str, Terms] = {}
        self._structure: dict[str, tuple] = shared.setdefault("structure", {})
        self._shared: dict[tuple, Terms] = shared.setdefault("terms", {})

    def _out_bytes(self, node: fx.Node, o: Option,
                   only: frozenset[int] | None = None) -> float:
        """Local bytes of ``node``'s tensor outputs under option ``o`` (those numbered in
        ``only``, when given)."""
        return sum(self.costs.local_bytes(v, pl)
                   for i, (v, pl) in enumerate(zip(tensor_vals(node), o.out))
                   if v is not None and pl is not None and (only is None or i in only))

    def _edge_cut(self, src: fx.Node, k: int, a: Any, g: Any) -> tuple[float, float]:
        """What a recomputing backward does when ``src``'s output ``k`` moves from ``a`` to
        ``g`` into a recomputed node: (bytes saved at the cut, seconds of re-gathering).

        Trailing all-gathers are run again from their saved input (their time is
        recomputation); the output of the last collective before them (a reduction) is
        saved instead of re-run: that is the cut. 0 bytes: no cut, ``src`` itself is
        needed (no collective but all-gathers)."""
        val = tensor_vals(src)[k]
        steps = list(self.costs.redistribute(a, g, tuple(val.shape), val.dtype)[1])
        regather = 0.0
        while steps and steps[-1].kind == "all_gather":
            regather += steps.pop().time_s
        if not steps:
            return 0.0, regather
        last = steps[-1]
        n = self.costs.mesh_shape[last.mesh_dim]
        return ({"reduce_scatter": last.bytes / n}.get(last.kind, float(last.bytes)),
                regather)

    def _is_state(self, node: fx.Node) -> bool:
        """Parameters, buffers and parameter-only values: not activations."""
        j = self.st.joint
        return node in self._param_only or (node.op == "placeholder"
                                             and node not in j.inputs.values())

    def _policy_structure(self, recompute: Recompute) -> tuple:
        """(forward nodes the backward reads directly, MUST_SAVE nodes, nodes reachable
        from the backward) of ``recompute``, from :func:`autopp.graph.recompute.recompute_sets`
        on this joint graph."""
        hit = self._structure.get(recompute)
        if hit is not None:
            return hit
        from autopp.graph.aot import from_aot_joint
        from autopp.graph.recompute import RecomputeSets, recompute_sets
        from autopp.graph.walk import closure

        gm = self.st.joint.gm
        try:
            flat, sig = from_aot_joint(gm)
        except ValueError:  # a joint without a usable signature (e.g. no backward)
            if recompute != "none":
                raise
            flat = sig = None
        if sig is None:
            names = {n.name for n in gm.graph.nodes if n.op == "call_function"}
            sets = RecomputeSets("none", frozenset(names), frozenset(), frozenset())
        else:
            sets = recompute_sets(flat, sig, recompute)
        by_name = {n.name: n for n in gm.graph.nodes}
        j = self.st.joint
        fwd = closure(list(j.outputs.values()))
        outs = [a for a in gm.graph.output_node().all_input_nodes]
        bwd_only = closure(outs) - fwd
        direct = {i for n in bwd_only for i in n.all_input_nodes if i in fwd}
        must = {by_name[n] for n in sets.must_save if n in by_name}
        reach = {by_name[n] for n in sets.saved | sets.recomputed if n in by_name}
        if sig is None:
            reach = set(direct)
        # a saved multi-output node that is read only through ``getitem``s of some of its
        # outputs (the others' getitems saved themselves, or unread) is saved for those
        # outputs only: e.g. attention's log-sum-exp, which only the backward unpacks, next
        # to its output, saved as the forward's own getitem
        readers = bwd_only | {n for n in reach if not self._is_saved_kind(n, must)}
        partial = {}
        for n in direct | reach:
            if len(tensor_vals(n)) < 2:
                continue
            users = [u for u in n.users if u in readers]
            if users and all(u.target is operator.getitem for u in users):
                partial[n] = frozenset(u.args[1] for u in users)
        hit = self._structure[recompute] = (direct, must, reach, partial)
        return hit

    def _is_saved_kind(self, node: fx.Node, must: set[fx.Node]) -> bool:
        return node.op != "call_function" or node in must

    def terms(self, recompute: Recompute) -> Terms:
        """The policy's columns, rows and per-column terms; built once for every activation
        factor (they do not read it: :meth:`coefs` weighs the activations), each row
        getting its own LP and arrays."""
        t = self._terms.get(recompute)
        if t is None:
            spec = self.memory
            split = spec.counts_activations and spec.splits
            key = (recompute, replace(spec, largest_tensor_bytes=None, activation_factor=(
                None if spec.activation_factor is None else 1.0),
                split_in_flight=((1.0, 1.0),) if split else ()))
            base = self._shared.get(key)
            if base is None:
                base = self._shared[key] = Terms(first_col=len(self._model.cost))
                self._state_terms(base)
                if spec.counts_activations or recompute != "none":
                    self._activation_terms(base, recompute)
                if spec.counts_activations:
                    self._gathered_terms(base)
                if split:
                    self._kept_terms(base)
            t = self._terms[recompute] = replace(
                base, upper=list(base.upper), rows=list(base.rows), lp=None, row_upper=None,
                arrays={}, peak_rows=[])
            if split:  # the peaks' rows: their coefficients are this accounting's own
                _add_peak_rows(t, spec.split_in_flight)
        return t

    def peak_coefs(self, t: Terms, first_row: int) -> tuple[tuple[int, int, float], ...]:
        """The (LP row, column, value) entries of ``t``'s peak rows that differ between
        accountings (``-a`` and ``-b`` of each peak), the rows counted from ``first_row``
        (the model's own rows come first): a warm LP built for other peaks is re-set to
        these (:class:`autopp.sharding.ilp.highs.WarmLps`)."""
        if t.held is None:
            return ()
        return tuple(e for r, (a, b) in zip(t.peak_rows, _padded(self.memory.split_in_flight))
                     for e in ((first_row + r, t.act_col, -a), (first_row + r, t.kept_col, -b)))

    def _state_terms(self, t: Terms) -> None:
        spec, j = self.memory, self.st.joint
        explicit = spec.optimizer_state_factor is not None
        f = 1.0 + spec.optimizer_state_factor if explicit else 1.0
        for fqn, node in j.params.items():
            pcols = [(self.col0[node] + i, self.param_bytes(node, o))
                     for i, o in enumerate(self.options[node])]
            for c, b in pcols:
                _add(t.state, c, b * f)
            if not explicit:
                continue
            # G_p in MiB, like the memory row: byte coefficients beside MiB rows span too
            # many orders of magnitude, and HiGHS's LP points then break the memory row
            grad = j.grads.get(fqn)
            g = t.col()
            t.state[g] = spec.gradient_copies * MIB
            t.row([(g, 1.0)] + [(c, -b / MIB) for c, b in pcols], 0.0)
            if grad is not None and grad in self.options and not spec.gradients_reduced:
                t.row([(g, 1.0)] + [(self.col0[grad] + i, -self.param_bytes(grad, o) / MIB)
                                    for i, o in enumerate(self.options[grad])], 0.0)

    def _activation_terms(self, t: Terms, recompute: Recompute) -> None:
        direct, must, reach, partial = self._policy_structure(recompute)
        nodes = [n for n in self.st.joint.gm.graph.nodes
                 if n in reach and not self._is_state(n) and n in self.options]
        known = set(nodes)
        reasons: dict[fx.Node, list[tuple[fx.Node, int]]] = {n: [] for n in nodes}
        for v in nodes:
            if not self._is_saved_kind(v, must):
                for i, (src, _) in enumerate(self.st.nodes[v].edges):
                    if src in known:
                        reasons[src].append((v, i))
        for n in nodes:
            opts = [(self.col0[n] + i, o) for i, o in enumerate(self.options[n])]
            if self._is_saved_kind(n, must):
                why = reasons[n]
                if (n not in direct and len(why) == 1 and why[0][0] in direct
                        and len(tensor_vals(n)) == 1 and self.edge_cols.get(why[0])):
                    # needed only by one surely recomputed node: saved unless that edge runs
                    # a collective (whose output is saved instead, counted below)
                    v, i = why[0]
                    k = self.st.nodes[v].edges[i][1]
                    for c, a, g in self.edge_cols[v, i]:
                        if not self._edge_cut(n, k, a, g)[0]:
                            _add(t.act, c, self.costs.local_bytes(tensor_vals(n)[k], a))
                else:
                    for c, o in opts:
                        _add(t.act, c, self._out_bytes(n, o, partial.get(n)))
                continue
            ns = self.st.nodes[n]
            for c, o in opts:
                _add(t.rtime, c, self.costs.compute_time(ns, o))
            for i, (src, k) in enumerate(ns.edges):
                if src in known:
                    for c, a, g in self.edge_cols.get((n, i), ()):
                        cut, regather = self._edge_cut(src, k, a, g)
                        _add(t.act, c, cut)
                        if regather:
                            _add(t.rtime, c, regather)

    def _gathered_terms(self, t: Terms) -> None:
        owned: dict[fx.Node, int | float] = {}  # 0.0 / 1.0 constants or a column
        for n in self.st.joint.gm.graph.nodes:
            if n not in self._param_only or n not in self.options:
                continue
            ns = self.st.nodes[n]
            if n.op == "placeholder":
                owned[n] = 0.0
            elif is_view(n) and len(ns.edges) == 1 \
                    and ns.edges[0][0] in owned:
                p = owned[ns.edges[0][0]]
                moved = [(c, 1.0) for c, a, g in self.edge_cols.get((n, 0), ()) if a != g]
                if p == 1.0:
                    owned[n] = 1.0
                elif not moved and p == 0.0:
                    owned[n] = 0.0
                else:
                    w = owned[n] = t.col(1.0)
                    if moved:
                        t.row([(w, 1.0)] + [(c, -1.0) for c, _ in moved], 0.0)
                    if not isinstance(p, float):
                        t.row([(w, 1.0), (p, -1.0)], 0.0)
            else:
                owned[n] = 1.0
        shared: dict[tuple, int] = {}
        for d, opts in self.options.items():
            if d in self._param_only:
                continue
            for i, (s, k) in enumerate(self.st.nodes[d].edges):
                if s not in owned:
                    continue
                by_g: dict[Any, list[int]] = {}
                for idx, o in enumerate(opts):
                    by_g.setdefault(o.ins[i], []).append(self.col0[d] + idx)
                for g, dcols in by_g.items():
                    key = (s, k, g)
                    w = shared.get(key)
                    if w is None:
                        w = shared[key] = t.col()
                        t.gathered[w] = self.costs.local_bytes(tensor_vals(s)[k], g)
                    reads = [(c, -1.0) for c in dcols]
                    same = [(self.col0[s] + idx, 1.0)
                            for idx, o in enumerate(self.options[s]) if o.out[k] == g]
                    t.row([(w, 1.0)] + reads + same, 0.0)
                    ow = owned[s]
                    if ow == 1.0:
                        t.row([(w, 1.0)] + reads, 0.0)
                    elif not isinstance(ow, float):
                        t.row([(w, 1.0)] + reads + [(ow, -1.0)], -1.0)

    def coefs(self, t: Terms) -> dict[int, float]:
        """Bytes per column of the memory row."""
        coefs = dict(t.state)
        f = self.memory.row_factor
        if f is not None:
            if t.held is not None:
                _add(coefs, t.held, MIB)
            else:
                for c, v in t.act.items():
                    _add(coefs, c, v * f)
            for c, v in t.gathered.items():
                _add(coefs, c, v * self.memory.gathered_share)
        return coefs

    def row_bytes(self, t: Terms, x: np.ndarray) -> float:
        """The memory row's value at the LP point ``x`` (bytes), the held column (if any)
        at the least its rows allow: unpriced, the solver may leave it anywhere above, and
        a solution shared by another accounting (``Model._time_only_hit``) carries
        that accounting's."""
        arrays = self.arrays(t)
        if t.held is not None:  # at the least its peak rows allow
            act = sum(v * x[c] for c, v in t.act.items())
            kept = sum(v * x[c] for c, v in t.kept.items())
            x = x.copy()
            x[t.held] = held_bytes(None, self.memory.split_in_flight, act, kept) / MIB
        # in the row's order, as a Python sum (the same float as term by term)
        return float(sum((arrays["mem_vals"] * x[arrays["mem_cols"]]).tolist()))

    def arrays(self, t: Terms) -> dict[str, Any]:
        """Per column of ``t``'s LP, made once: time (+ recomputation), the memory row's
        bytes, integrality; and the memory row as (columns, bytes) in its own order."""
        a = t.arrays
        if not a:
            n = len(self._model.cost) + len(t.upper)
            time = np.zeros(n)
            time[: len(self._model.cost)] = self._model.cost
            for c, v in t.rtime.items():
                time[c] += v
            coefs = self.coefs(t)
            mem = np.zeros(n)
            for c, v in coefs.items():
                mem[c] = v
            integer = self._model.integer + [False] * len(t.upper)
            a.update(time=time, mem=mem, integer=integer,
                     ints=np.asarray(integer, dtype=bool),
                     mem_cols=np.fromiter(coefs, dtype=np.int32, count=len(coefs)),
                     mem_vals=np.fromiter(coefs.values(), dtype=np.float64, count=len(coefs)))
        return a

    def account(self, choice: Mapping[fx.Node, Option], recompute: Recompute = "none"
                ) -> MemoryAccount:
        """Memory and recomputation of a full choice, exactly as the memory row counts them
        (see the module docstring), by walking the graph."""
        spec, j, costs = self.memory, self.st.joint, self.costs
        state = 0.0
        explicit = spec.optimizer_state_factor is not None
        f = 1.0 + spec.optimizer_state_factor if explicit else 1.0
        for fqn, node in j.params.items():
            pb = self.param_bytes(node, choice[node])
            state += pb * f
            if explicit:
                grad = j.grads.get(fqn)
                gb = self.param_bytes(grad, choice[grad]) if grad in choice else 0.0
                state += spec.gradient_copies * (pb if spec.gradients_reduced else max(pb, gb))
        act = rtime = 0.0
        if spec.counts_activations or recompute != "none":
            direct, must, _, partial = self._policy_structure(recompute)
            seen: set[fx.Node] = set()
            stack = [n for n in direct if not self._is_state(n) and n in choice]
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if self._is_saved_kind(n, must):
                    act += self._out_bytes(n, choice[n], partial.get(n))
                    continue
                ns = self.st.nodes[n]
                rtime += costs.compute_time(ns, choice[n])
                for i, (src, k) in enumerate(ns.edges):
                    if self._is_state(src) or src not in choice:
                        continue
                    cut, regather = self._edge_cut(src, k, choice[src].out[k],
                                                   choice[n].ins[i])
                    rtime += regather
                    if cut:
                        act += cut
                    else:
                        stack.append(src)
        gathered = 0.0
        if spec.counts_activations:
            owned: dict[fx.Node, bool] = {}
            for n in j.gm.graph.nodes:
                if n not in self._param_only or n not in choice:
                    continue
                ns = self.st.nodes[n]
                if n.op == "placeholder":
                    owned[n] = False
                elif is_view(n) and len(ns.edges) == 1 and ns.edges[0][0] in owned:
                    p, k = ns.edges[0]
                    owned[n] = owned[p] or choice[p].out[k] != choice[n].ins[0]
                else:
                    owned[n] = True
            held: set[tuple] = set()
            for d, o in choice.items():
                if d in self._param_only:
                    continue
                for i, (s, k) in enumerate(self.st.nodes[d].edges):
                    if s in owned:
                        g = o.ins[i]
                        if (s, k, g) not in held and (owned[s] or choice[s].out[k] != g):
                            held.add((s, k, g))
                            gathered += costs.local_bytes(tensor_vals(s)[k], g)
        kept = 0.0
        if spec.counts_activations and spec.split_in_flight:
            kept = self._kept_bytes(choice)
        counted = state
        if spec.activation_factor is not None:
            counted += spec.held_bytes(act, kept) + gathered * spec.gathered_share
        return MemoryAccount(state, act, gathered, rtime, counted, kept)

    # -- what a split backward keeps from I to W -------------------------------------------

    def kept_reads(self) -> dict[tuple[fx.Node, int], None]:
        """What a split backward keeps from I to W, as the edges (reader, argument index)
        that read it: the weight-gradient nodes' (reached from the parameter gradients, not
        from the input gradients nor the forward) reads of values they do not make, parameters
        and parameter-only values aside. Where such a value is an output of a multi-output
        backward op the input gradient needs too (a fused norm backward's weight gradient),
        that op's reads stand in for it where the lowered graphs decompose it, and W makes
        that output from them; an op they keep whole (the routed experts' backward) runs in
        I, and W keeps the output. Each edge counts in its producer's placement.
        Checked against the lowered W graphs' inputs by tests/sharding/test_memory_ilp.py;
        whole stages by benchmarks/split_backward_memory.py."""
        hit = self._structure.get("kept_for_w")
        if hit is not None:
            return hit
        from autopp.graph.walk import closure

        j, nodes = self.st.joint, self.st.nodes
        fwd = closure(list(j.outputs.values()))
        w_only = closure(list(j.grads.values())) - closure(list(j.input_grads.values())) - fwd
        state = self._param_only | set(j.params.values()) | set(j.buffers.values())
        out: dict[tuple[fx.Node, int], None] = {}
        for n in j.gm.graph.nodes:
            if n not in w_only or n not in nodes:
                continue
            for i, (src, k) in enumerate(nodes[n].edges):
                if src in w_only or src in state or src not in self.options:
                    continue
                if src not in fwd and len(tensor_vals(src)) > 1 and _remade_in_w(src):
                    out.update(dict.fromkeys(
                        (src, i2) for i2, e in enumerate(nodes[src].edges)
                        if e[0] not in state and e[0] in self.options))
                else:
                    out[n, i] = None
        self._structure["kept_for_w"] = out
        return out

    def _kept_edge_bytes(self, val: Any, a: Any) -> float:
        """A kept read's bytes: the value in its producer's placement ``a``, which is what W
        receives from I. A redistribution to the reader's placement that only W needs (a
        gather of an activation over dp for a weight gradient) runs in W, since W runs the
        collectives only it needs (``_compat.graph.split_di_dw_graph``); its result is W's
        working memory, which the lowered graphs' estimate counts (``work``), not a value
        held from I to W."""
        return self.costs.local_bytes(val, a)

    def _kept_terms(self, t: Terms) -> None:
        """``t.kept`` (bytes per column) and the two columns equal to one microbatch's
        activations and kept bytes (MiB), each with its defining row."""
        for d, i in self.kept_reads():
            src, k = self.st.nodes[d].edges[i]
            val = tensor_vals(src)[k]
            for c, a, _ in self.edge_cols.get((d, i), ()):
                t.kept[c] = t.kept.get(c, 0.0) + self._kept_edge_bytes(val, a)
        for name, terms in (("act_col", t.act), ("kept_col", t.kept)):
            col = t.col()
            setattr(t, name, col)
            t.row([(col, 1.0)] + [(c, -v / MIB) for c, v in terms.items()], 0.0, 0.0)

    def _kept_bytes(self, choice: Mapping[fx.Node, Option]) -> float:
        """One microbatch's kept bytes under a full choice (the accounting of ``t.kept``)."""
        total = 0.0
        for d, i in self.kept_reads():
            src, k = self.st.nodes[d].edges[i]
            if src in choice and d in choice:
                total += self._kept_edge_bytes(tensor_vals(src)[k], choice[src].out[k])
        return total


def _remade_in_w(node: fx.Node) -> bool:
    """Whether W can make a multi-output backward op's outputs from the op's reads: an aten
    op can be (a fused kernel the device lacks is decomposed when lowered:
    ``autopp.lower.local_graphs._missing_kernel_decomps``); an op of autopp's own (the routed
    experts' backward) is one kernel, run whole in I, whose outputs W keeps."""
    return getattr(node.target, "namespace", None) == "aten"
