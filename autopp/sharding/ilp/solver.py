r"""The sharding ILP of one unit (:class:`Model`), solved with HiGHS; each family's builder named.

    min  Σ c[v,o] x[v,o] + Σ r[e](a,g) y[e,a,g] + Σ R[v,o] x[v,o]  (+ λ · memory row)
    s.t. Σ_o x[v,o] = 1                          ∀ v   Model._one_option_per_node
         Σ_g y[e,a,g] = Σ_(o ∈ O_u^a) x[u,o],
         Σ_a y[e,a,g] = Σ_(o ∈ O_v^g) x[v,o]     ∀ e   Model._edge_flows (ties: _tie_edges)
         x[v,o] = 0 off a node's fixed placement       Model._upper_bounds
         x, y = 0 where a tensor exceeds the cap       Model.column_bytes
         State + f · Act + Gath ≤ M                     memory_row.MemoryRow.terms
         x ∈ {0, 1},  y ≥ 0
x picks a node's option (options/strategies.py), y carries an edge's (produced, required)
placement pair; c, r are compute and redistribution times (cost/model.py), R recomputation and
the row's terms are the memory row's (memory_row.py); M the budget, or λ its price
(``Model._costs_for``). The LP relaxation is integral in practice without the row, so
:meth:`Model.solve` runs the LP first and branches only on a fractional x."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from torch import fx

from autopp.graph.walk import param_only_nodes
from autopp.sharding.options import op_hooks
from autopp.sharding.cost.model import CostModel
from autopp.sharding.ilp.highs import WarmLps, highspy
from autopp.sharding.ilp.memory_row import MIB as _MIB  # the memory row's unit
from autopp.sharding.ilp.memory_row import MemoryAccount, MemoryRow, MemorySpec, Recompute, Terms
from autopp.sharding.options.option import PlacementSpec, matches
from autopp.format import format_bytes
from autopp.sharding.plan import CAP_DROPPED
from autopp.sharding.cost.redistribution_peaks import peak_table, redistribution_bytes
from autopp.sharding.ilp.solution import InfeasiblePlanError, SolveResult
from autopp.sharding.options.strategies import Option, Strategies, tensor_vals

logger = logging.getLogger(__name__)

_SCALE = 1e6
"""Costs go to the solver in microseconds so its tolerances sit far below one cost unit."""
BYTES_ONLY = -math.inf
"""The ``price`` of :meth:`Model.solve` that minimises the memory row alone."""
UNSHARD, REDUCE_GRAD = 0, 1
"""The kinds of a once-per-step edge (:func:`once_kind`), indices into the (UNSHARD,
REDUCE_GRAD) pairs of the planner (``Model.once_max_s``, ``SolveResult.once_comm_s``)."""
TIME_ONLY_LIMIT = 256
"""Time-only solutions a model keeps (:meth:`Model.solve`; per boundary pair and
recomputation policy: a few)."""


def once_kind(dst, i: int | None, src, param_nodes, param_only) -> int | None:
    """The kind of an ILP edge that runs once per step, or None for a per-microbatch edge:
    REDUCE_GRAD for a gradient flowing into its parameter (a tie, ``i`` None), UNSHARD for
    an edge out of a parameter-only value (a cast, view or gather of weights)."""
    if i is None and dst in param_nodes:
        return REDUCE_GRAD
    if src in param_only:
        return UNSHARD
    return None


class Model:
    """The ILP of one joint graph over all its options, built once.

    Constraints on inputs, outputs and parameters only change column bounds
    (:meth:`solve`), so the boundary pairs of a block reuse one model; the memory row and
    the recomputation costs are built once per recomputation policy.
    """

    def __init__(
        self,
        strategies: Strategies,
        costs: CostModel,
        memory_budget_bytes: float | None = None,
        grad_reduce_scale: float | tuple[float, float] = 1.0,
        *,
        memory: MemorySpec | None = None,
        once_weight: float = 1.0,
    ):
        self.st = strategies
        #: Factor on the edges that run once per step, not once per microbatch: 1/M when the
        #: pipeline has M microbatches. Those are the edges that reduce a gradient into its
        #: parameter's placement (the runtime sums the microbatches' gradients and reduces
        #: them once) and the edges out of parameter-only values (casts, views, gathers of
        #: weights: the runtime's UNSHARD runs them once per step, see autopp.graph.peel).
        #: A pair: (UNSHARD edges', REDUCE_GRAD edges') factors, e.g. (2, 1) with weights
        #: gathered block by block (gathered in every F and again in every I, gradients
        #: reduced every microbatch: :mod:`autopp.graph.weight_gathering`).
        self.grad_reduce_scale = grad_reduce_scale
        self._once_scales = (tuple(grad_reduce_scale) if isinstance(grad_reduce_scale, tuple)
                             else (grad_reduce_scale, grad_reduce_scale))
        #: Weight of those edges in the objective only (0: free, the planner's second look
        #: where the schedule may hide them, :mod:`autopp.sharding.chain.once_per_step`); what a
        #: solution records (its collectives, :attr:`SolveResult.once_comm_s`) is their time.
        self.once_weight = once_weight
        #: (UNSHARD, REDUCE_GRAD) seconds per microbatch the once-per-step edges cost at
        #: most (each at its dearest pair): no plan of this unit pays more.
        self.once_max_s = [0.0, 0.0]
        self._param_nodes = set(strategies.joint.params.values())
        self._param_only = param_only_nodes(strategies.joint.gm, self._param_nodes)
        self._state_only = param_only_nodes(
            strategies.joint.gm, self._param_nodes | set(strategies.joint.buffers.values()))
        self.costs = costs
        #: The default budget of :meth:`solve`.
        self.memory_budget_bytes = memory_budget_bytes
        self.memory = memory or MemorySpec()
        self.cost: list[float] = []
        self.integer: list[bool] = []
        #: Per column, the largest tensor its choice makes while the stage runs (an option's
        #: outputs, an edge pair's redistributed value), in bytes on one device; 0 for the
        #: step-long values the memory row counts instead (parameter-only values, gathered
        #: weights, gradients reduced into their parameters). What
        #: ``MemorySpec.largest_tensor_bytes`` bounds. Read it through :meth:`column_bytes`:
        #: the edge columns' redistribution paths are worked out on the first solve under a
        #: cap (a search's probes plan without one, and never pay for them).
        self.col_bytes: list[float] = []
        self._pending_bytes: list[tuple[int, Any, Any, Any]] = []
        self._col_bytes_array: np.ndarray | None = None
        mesh = strategies.mesh
        self._redist_bytes = peak_table(mesh)
        self.rows: list[tuple[list[int], list[float], float, float]] = []
        self.options: dict[fx.Node, list[Option]] = {
            n: ns.options for n, ns in strategies.nodes.items() if ns.options
        }
        self.col0: dict[fx.Node, int] = {}
        #: (consumer, argument index) -> [(column, producer placement, required placement)]:
        #: the columns that are 1 exactly when the edge carries that pair.
        self.edge_cols: dict[tuple[fx.Node, int], list[tuple[int, Any, Any]]] = {}
        self._one_option_per_node()
        self.num_x = len(self.cost)  # the option columns come first
        self._edge_flows()
        #: Time-only solves by the key of their LP (:meth:`_time_only_hit`), shared by the
        #: with_memory copies.
        self._time_only: dict[tuple, tuple] = {}
        #: The memory row's parts that do not depend on the activation factor, shared by the
        #: with_memory copies (:class:`MemoryRow`).
        self._shared_terms: dict[str, dict] = {}
        #: The memory row and recomputation costs, per recomputation policy.
        self.memory_row = MemoryRow(self, self._param_only, self._shared_terms)
        #: Solved LP relaxations kept for the next solve (a price search changes only the
        #: costs, another boundary pair only column bounds: the next solve starts from the
        #: last optimal basis; a polish, the memory row's bound), by recomputation policy.
        self._warm = WarmLps()

    def with_memory(self, memory: MemorySpec) -> Model:
        """This model under another memory accounting (another activation factor, state
        factor): the option and edge columns, their costs and rows are shared (they do not
        depend on it), and so are the warm LP relaxations (their memory row is set per
        solve); the memory row's weights are its own (its terms' columns and rows are
        shared: they do not read the activation factor)."""
        import copy

        other = copy.copy(self)
        other.memory = memory
        other.memory_row = MemoryRow(other, self._param_only, self._shared_terms)  # shared
        other._warm = self._warm  # keyed by the LP's structure; the memory row is re-set
        return other

    def new_col(self, cost: float, integer: bool, nbytes: float = 0.0) -> int:
        self.cost.append(cost)
        self.integer.append(integer)
        self.col_bytes.append(nbytes)
        return len(self.cost) - 1

    def _transient_bytes(self, node: fx.Node, o: Option) -> float:
        """The largest output of ``node`` under option ``o`` (0 for values computed from
        parameters and buffers alone: held for the step, counted as state or gathered)."""
        if node in self._state_only:
            return 0.0
        vals = tensor_vals(node)
        return max((self.costs.local_bytes(v, pl) for v, pl in zip(vals, o.out)
                    if pl is not None), default=0.0)

    def _one_option_per_node(self) -> None:
        for node, opts in self.options.items():
            ns = self.st.nodes[node]
            self.col0[node] = len(self.cost)
            for o in opts:
                self.new_col(self.costs.compute_time(ns, o), True, self._transient_bytes(node, o))
            self.rows.append((list(range(self.col0[node], len(self.cost))), [1.0] * len(opts), 1, 1))

    def _tie_edges(self):
        j = self.st.joint
        ties = [(j.params[f], g) for f, g in j.grads.items() if f in j.params]
        ties += [(j.tangents[i], o) for i, o in j.outputs.items() if i in j.tangents]
        ties += [(j.inputs[i], g) for i, g in j.input_grads.items() if i in j.inputs]
        # a buffer written in place by the forward ends in the buffer's own placement
        ties += [(j.buffers[f], u) for f, u in j.buffer_updates.items() if f in j.buffers]
        for target, src in ties:
            yield target, src, 0, [o.out[0] for o in self.options[target]], None

    def _all_edges(self):
        for node, opts in self.options.items():
            ns = self.st.nodes[node]
            for i, (src, k) in enumerate(ns.edges):
                yield node, src, k, [o.ins[i] for o in opts], i
        yield from self._tie_edges()

    def _allowed_pairs(self, dst: fx.Node, i: int | None):
        """(producer placement, required placement) pairs a follower edge, or an edge into
        a pinned argument (:mod:`op_hooks`: equal placements only), may carry."""
        ns = self.st.nodes[dst]
        if i is not None and ns.kind == "op" and i in _pinned(dst):
            return {(o.ins[i], o.ins[i]) for o in self.options[dst]}
        if i is None or ns.follows is None:
            return None
        return {(a, o.ins[i]) for o in self.options[dst] for a in ns.follows.get(o, ())}

    def _edge_flows(self) -> None:
        memo: dict[tuple, float] = {}  # keyed by object ids: the options outlive this loop

        def price(a, g, shape, dtype) -> float:
            key = (id(a), id(g), shape, dtype)
            t = memo.get(key)
            if t is None:
                t = memo[key] = self.costs.redistribute(a, g, shape, dtype)[0]
            return t

        for dst, src, k, need, i in self._all_edges():
            if src not in self.options:
                continue
            val = tensor_vals(src)[k]
            shape, dtype = tuple(val.shape), val.dtype
            scale = self.edge_scale(dst, i, src)
            once = self.once_kind(dst, i, src)
            weight = scale * (1.0 if once is None else self.once_weight)
            # the largest tensor a redistribution makes on its way (DTensor's own path, the
            # landed value included); once-per-step edges (gathers of weights, gradients
            # into their parameters) are the memory row's
            step_long = scale != 1.0 or (i is None and dst in self._param_nodes) \
                or src in self._state_only

            def lands(c: int, a, g, val=val, step_long=step_long) -> None:
                if not step_long:
                    self._pending_bytes.append((c, val, a, g))
            have: dict[Any, list[int]] = {}
            for idx, o in enumerate(self.options[src]):
                have.setdefault(o.out[k], []).append(self.col0[src] + idx)
            want: dict[Any, list[int]] = {}
            for idx, pl in enumerate(need):
                want.setdefault(pl, []).append(self.col0[dst] + idx)
            pairs = self._allowed_pairs(dst, i)
            cols: list[tuple[int, Any, Any]] = []
            if i is not None:
                self.edge_cols[dst, i] = cols
            if pairs is None and (len(have) == 1 or len(want) == 1):
                # One side is fixed: fold the edge's cost onto the other side's choices.
                dearest = 0.0
                for a, acols in have.items():
                    for g, gcols in want.items():
                        t = price(a, g, shape, dtype)
                        dearest = max(dearest, t)
                        for c in gcols if len(have) == 1 else acols:
                            self.cost[c] += t * weight
                            lands(c, a, g)
                            cols.append((c, a, g))
                if once is not None:
                    self.once_max_s[once] += dearest * scale
                continue
            if pairs is None:
                pairs = [(a, g) for a in have for g in want]
            else:
                # A producer placement the follower has no option for (e.g. its view would be
                # a pruned _StridedShard) is redistributed into any placement it accepts.
                covered = {a for a, _ in pairs}
                if i not in _pinned(dst):
                    pairs = [*pairs, *((a, g) for a in have if a not in covered for g in want)]
            by_a: dict[Any, list[int]] = {a: [] for a in have}
            by_g: dict[Any, list[int]] = {g: [] for g in want}
            dearest = 0.0
            for a, g in pairs:
                if a in have and g in want:
                    t = price(a, g, shape, dtype)
                    dearest = max(dearest, t)
                    c = self.new_col(t * weight, False)
                    lands(c, a, g)
                    by_a[a].append(c)
                    by_g[g].append(c)
                    cols.append((c, a, g))
            if once is not None:
                self.once_max_s[once] += dearest * scale
            for side, groups in ((by_a, have), (by_g, want)):
                for key, cols_ in groups.items():
                    ys = side[key]
                    self.rows.append((ys + cols_, [1.0] * len(ys) + [-1.0] * len(cols_), 0, 0))

    def column_bytes(self) -> np.ndarray:
        """:attr:`col_bytes` with every edge column's redistribution path included (worked
        out once, on first use, and shared with the :meth:`with_memory` copies)."""
        pending = self._pending_bytes
        if not pending and self._col_bytes_array is not None:
            return self._col_bytes_array
        for c, val, a, g in pending:
            self.col_bytes[c] = max(self.col_bytes[c], redistribution_bytes(
                self._redist_bytes, self.st.mesh, self.costs, val, a, g))
        pending.clear()  # in place: the copies share the list
        self._col_bytes_array = np.asarray(self.col_bytes)
        return self._col_bytes_array

    def once_kind(self, dst: fx.Node, i: int | None, src: fx.Node | None = None) -> int | None:
        """:func:`once_kind` of an edge of this graph."""
        return once_kind(dst, i, src, self._param_nodes, self._param_only)

    def edge_scale(self, dst: fx.Node, i: int | None, src: fx.Node | None = None) -> float:
        """Cost factor of an edge: :attr:`grad_reduce_scale` for one that runs once per
        step (:meth:`once_kind`); else 1."""
        kind = self.once_kind(dst, i, src)
        return 1.0 if kind is None else self._once_scales[kind]

    def param_bytes(self, node: fx.Node, o: Option) -> float:
        return self.costs.local_bytes(tensor_vals(node)[0], o.out[0])

    def account(self, choice: Mapping[fx.Node, Option], recompute: Recompute = "none"
                ) -> MemoryAccount:
        """Memory and recomputation of a full choice, exactly as the memory row counts them
        (:meth:`MemoryRow.account`)."""
        return self.memory_row.account(choice, recompute)

    def _lp_for(self, t: Terms):
        """The LP of the model plus ``t``'s columns and rows and the memory row (last)."""
        if t.lp is not None:
            return t.lp
        n_base = len(self.cost)
        n = n_base + len(t.upper)
        rows = self.rows + t.rows
        mem = self.memory_row.coefs(t)
        rows = rows + [(list(mem), [v / _MIB for v in mem.values()], -np.inf, np.inf)]
        lp = highspy().HighsLp()
        lp.num_col_ = n
        lp.num_row_ = len(rows)
        lp.col_lower_ = np.zeros(n)
        lp.row_lower_ = np.array([r[2] for r in rows], dtype=np.float64)
        lp.row_upper_ = t.row_upper = np.array([r[3] for r in rows], dtype=np.float64)
        starts, index, value = [0], [], []
        for idx, val, _, _ in rows:
            index += idx
            value += val
            starts.append(len(index))
        lp.a_matrix_.format_ = highspy().MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(value, dtype=np.float64)
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = len(rows)
        t.lp = lp
        return lp

    def _costs_for(self, t: Terms, price: float, least: str | None = None) -> np.ndarray:
        """Objective per column, in microseconds: time (+ recomputation) + price × bytes
        (``price``: seconds per byte). ``least``: the memory row first instead, in KiB
        ("bytes": alone; "tied": 1 byte per microsecond of time as the tie-break)."""
        time, mem = self.memory_row.arrays(t)["time"], self.memory_row.arrays(t)["mem"]
        if price == 0:
            return time * _SCALE
        if least == "bytes":
            return mem / 1024
        if least == "tied":
            # bytes, time as the tie-break at 1 byte per microsecond. A lighter time weight
            # sinks below HiGHS's tolerances on small models (an op of 1e-4 us weighs
            # 1e-10) and leaves the LP degenerate and slow.
            # Not strict: solve() checks the bytes against a bytes-only solve
            return (mem + time * _SCALE) / 1024
        return (time + price * mem) * _SCALE

    @property
    def num_vars(self) -> int:
        return len(self.cost)

    def _upper_bounds(self, restrict, names, budget) -> np.ndarray:
        upper = np.ones(len(self.cost))
        least = 0.0
        for node, spec in restrict.items():
            opts = self.options[node]
            ok = [matches(o.out[0], spec) for o in opts]
            if not any(ok):
                name = names.get(node, node.name)
                raise InfeasiblePlanError(
                    f"constraint {name} admits no placement of {node.name} "
                    f"(shape {tuple(tensor_vals(node)[0].shape)}, mesh "
                    f"{self.st.mesh_shape}): a required shard may not divide evenly"
                )
            for i, good in enumerate(ok):
                if not good:
                    upper[self.col0[node] + i] = 0.0
        legacy = not self.memory.counts_activations and self.memory.optimizer_state_factor is None
        if budget is not None and legacy:
            f = 1.0  # parameter bytes alone
            for node in self.st.joint.params.values():
                sizes = [
                    self.param_bytes(node, o) * f
                    for i, o in enumerate(self.options[node])
                    if upper[self.col0[node] + i] > 0
                ]
                least += min(sizes)
            if least > budget:
                raise InfeasiblePlanError(
                    f"memory_budget_bytes={budget:.4g} is below the least "
                    f"parameter memory any plan reaches ({least:.4g} bytes per device with "
                    f"state factor {f}); raise the budget, use more devices, or relax the "
                    "parameter constraints"
                )
        return upper

    def solve(
        self,
        restrict: Mapping[fx.Node, PlacementSpec] | None = None,
        restrict_names: Mapping[fx.Node, str] | None = None,
        *,
        time_limit_s: float = 60.0,
        threads: int = 2,
        recompute: Recompute = "none",
        budget: float | None | str = "default",
        price: float = 0.0,
        start: Mapping[fx.Node, Option] | None = None,
        rel_gap: float = 1e-6,
        max_nodes: int | None = None,
        round_fractional: bool = False,
        objective_target_s: float | None = None,
    ) -> SolveResult:
        """Solve with some nodes' placements restricted; raise InfeasiblePlanError naming them.

        ``recompute``: the backward's policy. ``budget``: bytes per device for the memory
        row (``"default"``: the model's; None: no bound). ``price``: seconds per byte of the
        row added to the objective (``inf``: least memory, time breaking ties;
        :data:`BYTES_ONLY`: the row alone). ``start``: a feasible MIP incumbent. ``rel_gap``,
        ``max_nodes``: the MIP's gap and node bound (the best by then is returned, with its
        bound).
        ``round_fractional``: return the rounding of a fractional LP relaxation (each node's largest
        option) with the LP's optimum as its bound, instead of the MIP. ``objective_target_s``: stop
        at the first solution at most this (a polish certified by a stronger bound)."""
        if budget == "default":
            budget = self.memory_budget_bytes
        least = None if not math.isinf(price) else "tied" if price > 0 else "bytes"
        restrict, names = dict(restrict or {}), dict(restrict_names or {})
        t = self.memory_row.terms(recompute)
        upper = np.concatenate([self._upper_bounds(restrict, names, budget),
                                np.asarray(t.upper, dtype=np.float64)])
        cap = self.memory.largest_tensor_bytes
        if cap is not None:
            uncapped = upper.copy()
            over = self.column_bytes() > cap
            upper[: len(over)][over] = 0.0
        # the LP's structure (all but the memory row's coefficients) and its objective's
        # kind: a basis optimal for least memory is a poor start for a time-first solve and
        # the reverse; a warm start gone astray is cut short (highs.WARM_GUARD)
        m = self.memory
        # (a split backward's peak rows: one structure for all peaks, coefficients re-set)
        warm = (recompute, m.optimizer_state_factor, m.counts_activations,
                len(t.upper), len(t.rows), least)
        # a time-only solve never reads the memory row: solved once for every activation
        # factor, re-counted under each (_time_only_hit)
        shared = None
        if price == 0 and budget is None and start is None:
            shared = (warm, upper.tobytes(), time_limit_s, threads, rel_gap, max_nodes,
                      round_fractional)
            hit = self._time_only_hit(shared, t, recompute, len(upper))
            if hit is not None:
                return hit
        lp = self._lp_for(t)
        t.row_upper[-1] = np.inf if budget is None else budget / _MIB
        lp.row_upper_ = t.row_upper
        lp.col_cost_ = self._costs_for(t, price, least)
        arrays = self.memory_row.arrays(t)
        integer, ints = arrays["integer"], arrays["ints"]
        mem_row = (arrays["mem_cols"], arrays["mem_vals"] / _MIB)
        peaks = self.memory_row.peak_coefs(t, len(self.rows))
        x, dt, status, obj, bound = self._warm.run(
            lp, upper, integer, False, time_limit_s, threads, scale=_SCALE, rel_gap=rel_gap,
            warm=warm, mem_row=mem_row, coefs=peaks)
        if x.size == 0 and cap is not None:
            # no plan keeps every tensor under the cap (with these restrictions): plan
            # without it, and say so (the stage's working memory may then not fit)
            upper = uncapped
            x, dt2, status, obj, bound = self._warm.run(
                lp, upper, integer, False, time_limit_s, threads, scale=_SCALE,
                rel_gap=rel_gap, warm=warm, mem_row=mem_row, coefs=peaks)
            dt += dt2
            status += (f" ({CAP_DROPPED} of {format_bytes(cap)} dropped: no plan keeps "
                       "every tensor under it)")
        fractional = bool(x.size) and bool(np.any((x[ints] > 1e-6) & (x[ints] < 1 - 1e-6)))
        rounded = fractional and round_fractional
        if rounded:
            status += " (LP relaxation fractional: rounded)"
        elif fractional and shared is not None and (fixed := self._warm.fix_and_solve(
                lp, upper, integer, x, bound, time_limit_s, threads, scale=_SCALE,
                rel_gap=rel_gap)) is not None:
            x, dt2, status, obj = fixed  # within FIX_GAP of the LP's optimum, its bound
            dt += dt2
        elif fractional:
            hint = None
            if start is not None:  # x columns of a feasible choice: 1 chosen, 0 the others
                vals = np.zeros(self.num_x)
                for n, o in start.items():
                    if n in self.col0 and o in self.options[n]:
                        vals[self.col0[n] + self.options[n].index(o)] = 1.0
                hint = (np.arange(self.num_x, dtype=np.int32), vals)
            x, dt2, status, obj, bound = self._warm.run(
                lp, upper, integer, True, time_limit_s, threads, scale=_SCALE, hint=hint,
                rel_gap=rel_gap, max_nodes=max_nodes, objective_target=objective_target_s,
                presolve=not (price == 0 and budget is None))
            dt += dt2
        elif x.size:
            status += " (LP relaxation integral)"
        if x.size == 0:
            listed = sorted(set(names.values()))
            if budget is not None:
                listed.append(f"memory_budget_bytes={budget:.4g}")
            raise InfeasiblePlanError.no_plan(status, listed, time_limit_s)
        choice: dict[fx.Node, Option] = {}
        for node, opts in self.options.items():
            vals = x[self.col0[node] : self.col0[node] + len(opts)]
            choice[node] = opts[int(np.argmax(vals))]
        res = self.evaluate(choice, num_vars=self.num_vars, solve_s=dt, status=status,
                            recompute=recompute)
        # a rounded LP has no memory row or objective value of its own (they belong to the
        # fractional point, whose optimum stays the bound): its evaluation is what it holds
        ilp_mem = float("nan") if rounded else self.memory_row.row_bytes(t, x)
        res = replace(res, ilp_objective_s=obj if price == 0 else float("nan"),
                      ilp_memory_bytes=ilp_mem, num_vars=len(integer),
                      bound_s=float("nan") if math.isinf(price) else bound,
                      ilp_value_s=float("nan") if math.isinf(price) or rounded else obj,
                      # the bytes-only objective is the memory row in KiB
                      memory_bound_bytes=bound * _SCALE * 1024 if least == "bytes"
                      else float("nan"))
        if shared is not None:
            self._time_only_keep(shared, res, x)
        return res

    def _time_only_hit(self, key: tuple, t: Terms, recompute: Recompute, n_cols: int
                       ) -> SolveResult | None:
        """The time-only solution kept under ``key``, its memory counted under this model's
        row (``t``: its terms for ``recompute``); None where there is none yet.

        A solve with neither a memory price nor a budget never reads the memory row, so its
        solution is the same under every accounting that shares the row's structure (another
        activation factor: a stage with another number of microbatches in flight). The key
        (made by :meth:`solve`) holds everything else the LP is made of: recomputation
        policy, state accounting, the row's structure (the LP's sizes), column bounds, time
        limit, threads, gap, node limit and rounding; the table stands for the model's own
        columns and costs, and is shared by its :meth:`with_memory` copies."""
        hit = self._time_only.get(key)
        if hit is None:
            return None
        res, cols, vals = hit
        acc = self.account(res.choice, recompute)
        ilp_mem = res.ilp_memory_bytes
        if ilp_mem == ilp_mem:  # not a rounded LP's (nan): the row at the solver's point
            x = np.zeros(n_cols)
            x[cols] = vals
            ilp_mem = self.memory_row.row_bytes(t, x)
        return replace(res, solve_s=0.0, state_bytes=acc.state_bytes,
                       activation_bytes=acc.activation_bytes,
                       gathered_bytes=acc.gathered_bytes,
                       kept_for_w_bytes=acc.kept_for_w_bytes, memory_bytes=acc.counted_bytes,
                       ilp_memory_bytes=ilp_mem)

    def _time_only_keep(self, key: tuple, res: SolveResult, x: np.ndarray) -> None:
        """Keep ``res`` (solved from the column values ``x``) under ``key``."""
        table = self._time_only
        if len(table) >= TIME_ONLY_LIMIT:
            table.pop(next(iter(table)))
        cols = np.flatnonzero(x)
        table[key] = (res, cols, x[cols])

    def evaluate(self, choice: Mapping[fx.Node, Option], *, num_vars: int = 0,
                 solve_s: float = 0.0, status: str = "evaluated",
                 recompute: Recompute = "none") -> SolveResult:
        """Price a full choice of options under the cost model (what the ILP objective
        measures) and its memory (:meth:`account`): what plans report."""
        costs, st = self.costs, self.st
        compute = sum(costs.compute_time(st.nodes[n], o) for n, o in choice.items())
        comm, colls, once = 0.0, [], [0.0, 0.0]
        for dst, src, k, _, i in self._all_edges():
            if src not in choice or dst not in choice:
                continue
            val = tensor_vals(src)[k]
            a = choice[src].out[k]
            g = choice[dst].out[0] if i is None else choice[dst].ins[i]
            t, steps = costs.redistribute(a, g, tuple(val.shape), val.dtype)
            scale = self.edge_scale(dst, i, src)
            kind = self.once_kind(dst, i, src)
            comm += t * scale * (1.0 if kind is None else self.once_weight)
            if kind is not None:
                once[kind] += t * scale
            colls += [(dst.name, src.name, dataclasses.replace(c, time_s=c.time_s * scale))
                      for c in steps]
        param_bytes = sum(self.param_bytes(n, choice[n]) for n in st.joint.params.values())
        acc = self.account(choice, recompute)
        return SolveResult(
            choice=dict(choice),
            objective_s=compute + comm + acc.recompute_s,
            compute_s=compute,
            comm_s=comm,
            collectives=tuple(colls),
            param_bytes=param_bytes,
            num_vars=num_vars,
            num_binary=int(sum(self.integer)),
            num_rows=len(self.rows),
            solve_s=solve_s,
            status=status,
            recompute=recompute,
            recompute_s=acc.recompute_s,
            state_bytes=acc.state_bytes,
            activation_bytes=acc.activation_bytes,
            gathered_bytes=acc.gathered_bytes,
            kept_for_w_bytes=acc.kept_for_w_bytes,
            memory_bytes=acc.counted_bytes,
            once_comm_s=(once[0], once[1]),
        )


def _pinned(node: fx.Node) -> tuple[int, ...]:
    """Tensor-argument positions of ``node`` its op hooks pin (:mod:`op_hooks`)."""
    hooks = op_hooks.hooks_of(node.target)
    return () if hooks is None else hooks.pinned


