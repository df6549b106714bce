r"""The sharding ILP, solved with HiGHS (highspy).

Notation: nodes :math:`v` of the joint graph, each with options :math:`o \in O_v`
(strategies.py); edges :math:`e = (u \to v, i)` (argument :math:`i` of :math:`v` produced by
:math:`u`). On edge :math:`e`, :math:`A_e` are the distinct placements :math:`u` can produce
and :math:`G_e` the distinct placements :math:`v` can require; :math:`O_u^a` are the options
of :math:`u` that produce :math:`a`, :math:`O_v^g` those of :math:`v` that require :math:`g`.

.. math::

    \min \; \sum_v \sum_{o} c_{v,o}\, x_{v,o} \;+\; \sum_e \sum_{a \in A_e, g \in G_e}
        r_e(a, g)\, y_{e,a,g}

    \text{s.t.}\quad \sum_{o \in O_v} x_{v,o} = 1                      \quad\forall v
        \qquad\text{(\_one\_option\_per\_node)}

    \sum_{g} y_{e,a,g} = \sum_{o \in O_u^a} x_{u,o},\quad
    \sum_{a} y_{e,a,g} = \sum_{o \in O_v^g} x_{v,o}                   \quad\forall e
        \qquad\text{(\_edge\_flows)}

    \text{State} + f \cdot \text{Act} + \text{Gath} \le M
        \qquad\text{(\_terms\_for, one row per recomputation policy)}

    \text{objective} \mathrel{+}= \text{Recomp} \;(+\; \lambda \cdot \text{the row, when
        priced instead of bounded})

    x \in \{0,1\}, \quad y \ge 0

:math:`c_{v,o}` is the compute time of the option, :math:`r_e(a,g)` the redistribution time
(costs.py) and :math:`M` the per-device memory budget. The edge-flow variables carry the
joint choice of both ends with marginal constraints; without the memory row their LP
relaxation is integral in practice (facts.md), so :meth:`Model.solve` solves the LP first and
branches only when some :math:`x` is fractional.

The memory row (:class:`MemorySpec`, per device, bytes; :meth:`Model.account` walks a
chosen plan and counts the same categories exactly, which is what plans report):

* State (``_state_terms``). Legacy (``optimizer_state_factor=None``):
  :math:`\sum_p \sum_o s\, m_{p,o} x_{p,o}` with :math:`m_{p,o}` the parameter's local
  bytes and :math:`s` = ``param_state_factor`` (everything sharded like the parameter).
  Explicit categories: :math:`\sum_p [(1 + s_{opt}) \sum_o m_{p,o} x_{p,o} + G_p]`,
  :math:`G_p \ge \sum_o m_{p,o} x_{p,o}`, :math:`G_p \ge \sum_o m_{\nabla p,o}
  x_{\nabla p,o}`: parameters, optimizer state sharded like them, and the gradient at the
  larger of its reduced size and its size before reduction (the step's accumulator, e.g. dp
  times a dp-sharded parameter: gradients are reduced once per step).
* Act (``_activation_terms``), only when ``activation_factor`` :math:`f` is set: the
  forward values the backward reads, under the recomputation policy of
  :func:`autopp.graph.recompute.recompute_sets` (``"none"``: every forward value a backward
  node reads; ``"selective"`` / ``"full"``: its ``MUST_SAVE`` values and inputs reached from
  the backward through recomputed nodes), each at :math:`\sum_o b_{u,o} x_{u,o}` (local
  bytes in the chosen placement). Parameter-only values (views, casts of weights: the
  unshard graph's) are state, not activations. A recomputing backward never re-runs a
  collective: on an edge :math:`e` into a recomputed node whose pair :math:`(a, g)` runs one,
  the collective's output is saved, :math:`\sum_{(a,g)} b_e(a,g)\, y_{e,a,g}`, and the
  producer is not needed through that edge. That cut is exact where a saved value is needed
  only through one edge into a node the backward surely recomputes (a row-parallel
  matmul's partial output before its all-reduce: counted :math:`\sum_{(a,g)\,\text{no
  collective}} b_u(a)\, y_{e,a,g}`); deeper cuts are not modelled (the producers are
  counted as needed: an upper bound; :meth:`Model.account` walks the chosen plan exactly).
  A recomputed node adds :math:`\sum_o c_{v,o} x_{v,o}` to the objective (the backward
  runs it again; also counted where a cut makes it unnecessary).
* Gath (``_gathered_terms``), with ``activation_factor`` set: the parameter-only values
  other nodes read (the unshard graph's outputs, held once per step), per distinct
  (value, required placement :math:`g`): :math:`W_{s,g} \ge \sum_{o \in O_d^g} x_{d,o} -
  \sum_{o: out = g} x_{s,o}` (redistributed for a reader :math:`d`) and :math:`W_{s,g} \ge
  \sum_{o \in O_d^g} x_{d,o} + w_s - 1` with :math:`w_s` = 1 when :math:`s` is new memory
  already (a cast, or a view of a gathered value); a parameter or a view of one read in its
  own placement costs nothing. Counted at :math:`b_s(g) W_{s,g}`.

The auxiliary variables :math:`G_p, W_{s,g}, w_s` are continuous and only bounded below;
priced (below) they sit at their bounds, and with integral :math:`x` the row then equals
:meth:`Model.account` up to the deeper cuts above (``SolveResult.ilp_memory_bytes`` vs
``memory_bytes``). :meth:`Model.solve` takes the budget as the row's bound, or a price per
byte added to the objective instead (Lagrangian: the row stays out of the constraints, so
the LP relaxation stays integral in practice; planner.py searches the price).

Edges: when an edge has a single placement on one side, its cost is folded onto the other
side's :math:`x` and no :math:`y` is made; on a follower edge (single-input op,
``NodeStrategy.follows``) only the pairs its options were
derived from get a :math:`y` (``_allowed_pairs``).

Ties are edges too (``_tie_edges``): a parameter's gradient flows into the parameter node,
which requires its own placement, so the gradient ends reduced in the parameter's placement
and the reduction (all-reduce / reduce-scatter over dp) is priced; likewise a forward output
flows into its tangent and a user input's gradient into the input. Input/output/parameter
constraints set the upper bound of the excluded options to 0 (``_upper_bounds``), so one
built model serves every boundary pair of a block.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import highspy
import numpy as np
from torch import fx

from autopp.sharding.costs import Collective, CostModel
from autopp.sharding.strategies import VIEW_OPS, Option, Strategies, tensor_vals

PlacementSpec = Sequence[Any | None]
"""Per mesh dim: a torch Placement, or None for "any"."""


_SCALE = 1e6
"""Costs go to the solver in microseconds so its tolerances sit far below one cost unit."""


_BANNER_SHOWN = False


def _new_highs() -> highspy.Highs:
    """A HiGHS instance. The first one a process creates prints HiGHS's banner on the C
    stdout before any option can be set; that one is created with fd 1 pointed at
    /dev/null, so every rank of a job does not print it."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return highspy.Highs()
    _BANNER_SHOWN = True
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class InfeasiblePlanError(ValueError):
    """The constraints admit no plan; the message names them."""


Recompute = str
"""A recomputation policy: ``"none"``, ``"selective"`` or ``"full"`` (see
:mod:`autopp.graph.recompute`)."""

_MIB = float(2**20)
"""The memory row is in MiB, so its coefficients sit near the cost columns' scale."""


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """What the per-device memory row counts (module docstring, "The memory row")."""

    param_state_factor: float = 1.0
    """Legacy state: bytes held per parameter byte, all sharded like the parameter
    (parameters, gradients, optimizer state; e.g. 4 for fp32 AdamW). Only when
    :attr:`optimizer_state_factor` is None."""
    optimizer_state_factor: float | None = None
    """Explicit state categories: optimizer state bytes per parameter byte, sharded like the
    parameter (AdamW with fp32 parameters: 2.0), plus the parameters and their gradients
    (at the larger of the reduced and the unreduced size)."""
    activation_factor: float | None = None
    """Microbatches in flight on the stage: activations count this many times and gathered
    parameters once. None: neither is counted (the legacy parameter-only row)."""

    @property
    def counts_activations(self) -> bool:
        return self.activation_factor is not None


@dataclass(frozen=True, slots=True)
class MemoryAccount:
    """Per-device bytes of one choice (:meth:`Model.account`)."""

    state_bytes: float
    """Parameters and their state as :class:`MemorySpec` counts them."""
    activation_bytes: float
    """Saved for the backward by one microbatch (before the activation factor)."""
    gathered_bytes: float
    """Parameter-only values other nodes read (gathered / cast weights), once per step."""
    recompute_s: float
    """Compute time of the forward nodes the backward recomputes (one microbatch)."""
    counted_bytes: float
    """What the memory row counts: state + factor × activations + gathered (or the state
    alone without an activation factor)."""


@dataclass(frozen=True, slots=True)
class SolveResult:
    choice: dict[fx.Node, Option]
    objective_s: float
    """Estimated time: compute + communication + recomputation."""
    compute_s: float
    comm_s: float
    collectives: tuple[tuple[str, str, Collective], ...]
    """(consumer node, producer node, collective) of every chosen redistribution."""
    param_bytes: float
    """Per-device parameter bytes (without the state factor)."""
    num_vars: int
    num_binary: int
    num_rows: int
    solve_s: float
    status: str
    ilp_objective_s: float = float("nan")
    """The solver's objective; equals :attr:`objective_s` up to tolerances (a consistency
    check between the ILP and :func:`evaluate`) when solved without a memory price."""
    recompute: str = "none"
    recompute_s: float = 0.0
    """Forward time the backward spends recomputing (in :attr:`objective_s`)."""
    state_bytes: float = 0.0
    activation_bytes: float = 0.0
    """Per microbatch, under :attr:`recompute`."""
    gathered_bytes: float = 0.0
    memory_bytes: float = 0.0
    """What the memory row counts for this choice (:class:`MemoryAccount`)."""
    ilp_memory_bytes: float = float("nan")
    """The memory row's value in the solver's solution (equals :attr:`memory_bytes` up to
    tolerances)."""


@dataclass(slots=True)
class Problem:
    """What to solve: candidates, prices and constraints."""

    strategies: Strategies
    costs: CostModel
    restrict: dict[fx.Node, PlacementSpec] = field(default_factory=dict)
    """Allowed output placements of some nodes (inputs, tangents, parameters)."""
    restrict_names: dict[fx.Node, str] = field(default_factory=dict)
    """Human name of each restriction, for error messages."""
    memory_budget_bytes: float | None = None
    param_state_factor: float = 1.0
    time_limit_s: float = 60.0
    threads: int = 2


def _matches(pl: tuple, spec: PlacementSpec) -> bool:
    return all(s is None or p == s for p, s in zip(pl, spec))


@dataclass(slots=True)
class _Terms:
    """The memory row and recomputation costs of one policy: extra (continuous) columns
    after the model's own, rows over both, and per-column coefficients."""

    first_col: int
    upper: list[float] = field(default_factory=list)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)
    state: dict[int, float] = field(default_factory=dict)
    act: dict[int, float] = field(default_factory=dict)
    gathered: dict[int, float] = field(default_factory=dict)
    rtime: dict[int, float] = field(default_factory=dict)
    """Seconds of recomputation per column (objective)."""
    lp: Any = None
    row_upper: Any = None

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
        param_state_factor: float = 1.0,
        grad_reduce_scale: float = 1.0,
        *,
        memory: MemorySpec | None = None,
    ):
        self.st = strategies
        #: Factor on the edges that run once per step, not once per microbatch: 1/M when the
        #: pipeline has M microbatches. Those are the edges that reduce a gradient into its
        #: parameter's placement (the runtime sums the microbatches' gradients and reduces
        #: them once) and the edges out of parameter-only values (casts, views, gathers of
        #: weights: the runtime's UNSHARD runs them once per step, see autopp.graph.peel).
        self.grad_reduce_scale = grad_reduce_scale
        self._param_nodes = set(strategies.joint.params.values())
        self._param_only = _param_only_nodes(strategies.joint.gm, self._param_nodes)
        self.costs = costs
        #: The default budget of :meth:`solve`.
        self.memory_budget_bytes = memory_budget_bytes
        self.memory = memory or MemorySpec(param_state_factor=param_state_factor)
        self.param_state_factor = self.memory.param_state_factor
        self.cost: list[float] = []
        self.integer: list[bool] = []
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
        self._terms: dict[str, _Terms] = {}
        self._structure: dict[str, tuple] = {}

    def new_col(self, cost: float, integer: bool) -> int:
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.cost) - 1

    def _one_option_per_node(self) -> None:
        for node, opts in self.options.items():
            ns = self.st.nodes[node]
            self.col0[node] = len(self.cost)
            for o in opts:
                self.new_col(self.costs.compute_time(ns, o), True)
            self.rows.append((list(range(self.col0[node], len(self.cost))), [1.0] * len(opts), 1, 1))

    def _tie_edges(self):
        j = self.st.joint
        ties = [(j.params[f], g) for f, g in j.grads.items() if f in j.params]
        ties += [(j.tangents[i], o) for i, o in j.outputs.items() if i in j.tangents]
        ties += [(j.inputs[i], g) for i, g in j.input_grads.items() if i in j.inputs]
        for target, src in ties:
            yield target, src, 0, [o.out[0] for o in self.options[target]], None

    def _all_edges(self):
        for node, opts in self.options.items():
            ns = self.st.nodes[node]
            for i, (src, k) in enumerate(ns.edges):
                yield node, src, k, [o.ins[i] for o in opts], i
        yield from self._tie_edges()

    def _allowed_pairs(self, dst: fx.Node, i: int | None):
        """(producer placement, required placement) pairs a follower edge may carry."""
        ns = self.st.nodes[dst]
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
                for a, acols in have.items():
                    for g, gcols in want.items():
                        t = price(a, g, shape, dtype) * scale
                        for c in gcols if len(have) == 1 else acols:
                            self.cost[c] += t
                            cols.append((c, a, g))
                continue
            if pairs is None:
                pairs = [(a, g) for a in have for g in want]
            else:
                # A producer placement the follower has no option for (e.g. its view would be
                # a pruned _StridedShard) is redistributed into any placement it accepts.
                covered = {a for a, _ in pairs}
                pairs = [*pairs, *((a, g) for a in have if a not in covered for g in want)]
            by_a: dict[Any, list[int]] = {a: [] for a in have}
            by_g: dict[Any, list[int]] = {g: [] for g in want}
            for a, g in pairs:
                if a in have and g in want:
                    c = self.new_col(price(a, g, shape, dtype) * scale, False)
                    by_a[a].append(c)
                    by_g[g].append(c)
                    cols.append((c, a, g))
            for side, groups in ((by_a, have), (by_g, want)):
                for key, cols_ in groups.items():
                    ys = side[key]
                    self.rows.append((ys + cols_, [1.0] * len(ys) + [-1.0] * len(cols_), 0, 0))

    def edge_scale(self, dst: fx.Node, i: int | None, src: fx.Node | None = None) -> float:
        """Cost factor of an edge: :attr:`grad_reduce_scale` for a gradient-to-parameter tie
        and for an edge out of a parameter-only value (once per step); else 1."""
        once_per_step = (i is None and dst in self._param_nodes) or src in self._param_only
        return self.grad_reduce_scale if once_per_step else 1.0

    def param_bytes(self, node: fx.Node, o: Option) -> float:
        return self.costs.local_bytes(tensor_vals(node)[0], o.out[0])

    # -- memory ----------------------------------------------------------------------------

    def _out_bytes(self, node: fx.Node, o: Option) -> float:
        """Local bytes of all of ``node``'s tensor outputs under option ``o``."""
        return sum(self.costs.local_bytes(v, pl) for v, pl in zip(tensor_vals(node), o.out)
                   if v is not None and pl is not None)

    def _collective_out_bytes(self, src: fx.Node, k: int, a: Any, g: Any) -> float:
        """Local bytes of the last collective's output when ``src``'s output ``k`` moves from
        ``a`` to ``g`` (0 when the move runs no collective): what a recomputing backward
        saves instead of re-running the collective."""
        val = tensor_vals(src)[k]
        steps = self.costs.redistribute(a, g, tuple(val.shape), val.dtype)[1]
        if not steps:
            return 0.0
        last = steps[-1]
        n = self.costs.mesh_shape[last.mesh_dim]
        return {"all_gather": last.bytes * n, "reduce_scatter": last.bytes / n}.get(
            last.kind, float(last.bytes))

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
        fwd = _closure(list(j.outputs.values()))
        outs = [a for a in gm.graph.output_node().all_input_nodes]
        bwd_only = _closure(outs) - fwd
        direct = {i for n in bwd_only for i in n.all_input_nodes if i in fwd}
        must = {by_name[n] for n in sets.must_save if n in by_name}
        reach = {by_name[n] for n in sets.saved | sets.recomputed if n in by_name}
        if sig is None:
            reach = set(direct)
        hit = self._structure[recompute] = (direct, must, reach)
        return hit

    def _is_saved_kind(self, node: fx.Node, must: set[fx.Node]) -> bool:
        return node.op != "call_function" or node in must

    def _terms_for(self, recompute: Recompute) -> _Terms:
        t = self._terms.get(recompute)
        if t is None:
            t = self._terms[recompute] = _Terms(first_col=len(self.cost))
            self._state_terms(t)
            if self.memory.counts_activations or recompute != "none":
                self._activation_terms(t, recompute)
            if self.memory.counts_activations:
                self._gathered_terms(t)
        return t

    def _state_terms(self, t: _Terms) -> None:
        spec, j = self.memory, self.st.joint
        explicit = spec.optimizer_state_factor is not None
        f = 1.0 + spec.optimizer_state_factor if explicit else spec.param_state_factor
        for fqn, node in j.params.items():
            pcols = [(self.col0[node] + i, self.param_bytes(node, o))
                     for i, o in enumerate(self.options[node])]
            for c, b in pcols:
                _add(t.state, c, b * f)
            if not explicit:
                continue
            grad = j.grads.get(fqn)
            g = t.col()
            t.state[g] = 1.0
            t.row([(g, 1.0)] + [(c, -b) for c, b in pcols], 0.0)
            if grad is not None and grad in self.options:
                t.row([(g, 1.0)] + [(self.col0[grad] + i, -self.param_bytes(grad, o))
                                    for i, o in enumerate(self.options[grad])], 0.0)

    def _activation_terms(self, t: _Terms, recompute: Recompute) -> None:
        direct, must, reach = self._policy_structure(recompute)
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
                        if not self._collective_out_bytes(n, k, a, g):
                            _add(t.act, c, self.costs.local_bytes(tensor_vals(n)[k], a))
                else:
                    for c, o in opts:
                        _add(t.act, c, self._out_bytes(n, o))
                continue
            ns = self.st.nodes[n]
            for c, o in opts:
                _add(t.rtime, c, self.costs.compute_time(ns, o))
            for i, (src, k) in enumerate(ns.edges):
                if src in known:
                    for c, a, g in self.edge_cols.get((n, i), ()):
                        _add(t.act, c, self._collective_out_bytes(src, k, a, g))

    def _gathered_terms(self, t: _Terms) -> None:
        owned: dict[fx.Node, int | float] = {}  # 0.0 / 1.0 constants or a column
        for n in self.st.joint.gm.graph.nodes:
            if n not in self._param_only or n not in self.options:
                continue
            ns = self.st.nodes[n]
            if n.op == "placeholder":
                owned[n] = 0.0
            elif (n.target in VIEW_OPS or n.target is operator.getitem) and len(ns.edges) == 1 \
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

    def _memory_coefs(self, t: _Terms) -> dict[int, float]:
        """Bytes per column of the memory row."""
        coefs = dict(t.state)
        f = self.memory.activation_factor
        if f is not None:
            for c, v in t.act.items():
                _add(coefs, c, v * f)
            for c, v in t.gathered.items():
                _add(coefs, c, v)
        return coefs

    def account(self, choice: Mapping[fx.Node, Option], recompute: Recompute = "none"
                ) -> MemoryAccount:
        """Memory and recomputation of a full choice, exactly as the memory row counts them
        (see the module docstring), by walking the graph."""
        spec, j, costs = self.memory, self.st.joint, self.costs
        state = 0.0
        explicit = spec.optimizer_state_factor is not None
        f = 1.0 + spec.optimizer_state_factor if explicit else spec.param_state_factor
        for fqn, node in j.params.items():
            pb = self.param_bytes(node, choice[node])
            state += pb * f
            if explicit:
                grad = j.grads.get(fqn)
                gb = self.param_bytes(grad, choice[grad]) if grad in choice else 0.0
                state += max(pb, gb)
        act = rtime = 0.0
        if spec.counts_activations or recompute != "none":
            direct, must, _ = self._policy_structure(recompute)
            seen: set[fx.Node] = set()
            stack = [n for n in direct if not self._is_state(n) and n in choice]
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if self._is_saved_kind(n, must):
                    act += self._out_bytes(n, choice[n])
                    continue
                ns = self.st.nodes[n]
                rtime += costs.compute_time(ns, choice[n])
                for i, (src, k) in enumerate(ns.edges):
                    if self._is_state(src) or src not in choice:
                        continue
                    cut = self._collective_out_bytes(src, k, choice[src].out[k],
                                                     choice[n].ins[i])
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
                elif (n.target in VIEW_OPS or n.target is operator.getitem) \
                        and len(ns.edges) == 1 and ns.edges[0][0] in owned:
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
        counted = state
        if spec.activation_factor is not None:
            counted += spec.activation_factor * act + gathered
        return MemoryAccount(state, act, gathered, rtime, counted)

    def _lp_for(self, t: _Terms):
        """The LP of the model plus ``t``'s columns and rows and the memory row (last)."""
        if t.lp is not None:
            return t.lp
        n_base = len(self.cost)
        n = n_base + len(t.upper)
        rows = self.rows + t.rows
        mem = self._memory_coefs(t)
        rows = rows + [(list(mem), [v / _MIB for v in mem.values()], -np.inf, np.inf)]
        lp = highspy.HighsLp()
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
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(value, dtype=np.float64)
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = len(rows)
        t.lp = lp
        return lp

    def _costs_for(self, t: _Terms, price: float) -> np.ndarray:
        """Objective per column, in microseconds: time (+ recomputation) + price × bytes
        (``price``: seconds per byte; ``inf``: memory first, time only as a tie-break)."""
        n = len(self.cost) + len(t.upper)
        time = np.zeros(n)
        time[: len(self.cost)] = self.cost
        for c, v in t.rtime.items():
            time[c] += v
        if price == 0:
            return time * _SCALE
        mem = np.zeros(n)
        for c, v in self._memory_coefs(t).items():
            mem[c] = v
        if math.isinf(price):
            return mem / 1024 + time * _SCALE * 1e-3  # KiB; 100 us of time weigh 0.1 KiB
        return (time + price * mem) * _SCALE

    @property
    def num_vars(self) -> int:
        return len(self.cost)

    def _upper_bounds(self, restrict, names, budget) -> np.ndarray:
        upper = np.ones(len(self.cost))
        least = 0.0
        for node, spec in restrict.items():
            opts = self.options[node]
            ok = [_matches(o.out[0], spec) for o in opts]
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
            f = self.param_state_factor
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
    ) -> SolveResult:
        """Solve with some nodes' placements restricted; raise InfeasiblePlanError naming them.

        ``recompute``: the backward's recomputation policy (memory and time). ``budget``:
        bytes per device for the memory row (``"default"``: the model's
        ``memory_budget_bytes``; None: no bound). ``price``: seconds per byte of the memory
        row added to the objective (Lagrangian; ``inf``: least memory first). ``start``: a
        feasible choice to start branching from (a MIP incumbent)."""
        if budget == "default":
            budget = self.memory_budget_bytes
        restrict, names = dict(restrict or {}), dict(restrict_names or {})
        t = self._terms_for(recompute)
        upper = np.concatenate([self._upper_bounds(restrict, names, budget),
                                np.asarray(t.upper, dtype=np.float64)])
        lp = self._lp_for(t)
        t.row_upper[-1] = np.inf if budget is None else budget / _MIB
        lp.row_upper_ = t.row_upper
        lp.col_cost_ = self._costs_for(t, price)
        integer = self.integer + [False] * len(t.upper)
        ints = np.asarray(integer, dtype=bool)
        x, dt, status, obj = self._run(lp, upper, integer, False, time_limit_s, threads)
        if x.size and np.any((x[ints] > 1e-6) & (x[ints] < 1 - 1e-6)):
            hint = None
            if start is not None:  # x columns of a feasible choice: 1 chosen, 0 the others
                vals = np.zeros(self.num_x)
                for n, o in start.items():
                    if n in self.col0 and o in self.options[n]:
                        vals[self.col0[n] + self.options[n].index(o)] = 1.0
                hint = (np.arange(self.num_x, dtype=np.int32), vals)
            x, dt2, status, obj = self._run(lp, upper, integer, True, time_limit_s, threads,
                                            hint)
            dt += dt2
        elif x.size:
            status += " (LP relaxation integral)"
        if x.size == 0:
            listed = sorted(set(names.values()))
            if budget is not None:
                listed.append(f"memory_budget_bytes={budget:.4g}")
            raise InfeasiblePlanError(
                f"no sharding plan satisfies the constraints together (solver: {status}); "
                f"constraints in force: {listed}"
            )
        choice: dict[fx.Node, Option] = {}
        for node, opts in self.options.items():
            vals = x[self.col0[node] : self.col0[node] + len(opts)]
            choice[node] = opts[int(np.argmax(vals))]
        res = evaluate(self, choice, num_vars=self.num_vars, solve_s=dt, status=status,
                       recompute=recompute)
        mem = self._memory_coefs(t)
        ilp_mem = float(sum(v * x[c] for c, v in mem.items()))
        return replace(res, ilp_objective_s=obj if price == 0 else float("nan"),
                       ilp_memory_bytes=ilp_mem, num_vars=len(integer))

    def _run(self, lp, upper, integer: list[bool], as_mip: bool, time_limit_s: float,
             threads: int, hint=None):
        lp.col_upper_ = upper
        kint, kcont = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [kint if b else kcont for b in integer] if as_mip else []
        h = _new_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("threads", int(threads))
        h.setOptionValue("mip_rel_gap", 1e-6)
        h.setOptionValue("mip_heuristic_effort", 0.3)  # measured: finds incumbents sooner
        t0 = time.perf_counter()
        h.passModel(lp)
        if hint is not None:
            h.setSolution(len(hint[0]), *hint)
        h.run()
        dt = time.perf_counter() - t0
        status = h.modelStatusToString(h.getModelStatus())
        sol = h.getSolution()
        if not sol.value_valid:
            return np.zeros(0), dt, status, 0.0
        obj = h.getInfo().objective_function_value / _SCALE
        return np.asarray(sol.col_value), dt, status, obj


def solve(prob: Problem) -> SolveResult:
    """Build and solve one problem (see :class:`Model` to reuse a build)."""
    model = Model(prob.strategies, prob.costs, prob.memory_budget_bytes, prob.param_state_factor)
    return model.solve(
        prob.restrict, prob.restrict_names, time_limit_s=prob.time_limit_s, threads=prob.threads
    )


def evaluate(
    model: Model,
    choice: Mapping[fx.Node, Option],
    *,
    num_vars: int = 0,
    solve_s: float = 0.0,
    status: str = "evaluated",
    recompute: Recompute = "none",
) -> SolveResult:
    """Price a full choice of options under the cost model (what the ILP objective measures)
    and its memory (:meth:`Model.account`)."""
    costs, st = model.costs, model.st
    compute = sum(costs.compute_time(st.nodes[n], o) for n, o in choice.items())
    comm, colls = 0.0, []
    for dst, src, k, _, i in model._all_edges():
        if src not in choice or dst not in choice:
            continue
        val = tensor_vals(src)[k]
        a = choice[src].out[k]
        g = choice[dst].out[0] if i is None else choice[dst].ins[i]
        t, steps = costs.redistribute(a, g, tuple(val.shape), val.dtype)
        scale = model.edge_scale(dst, i, src)
        comm += t * scale
        colls += [(dst.name, src.name, dataclasses.replace(c, time_s=c.time_s * scale))
                  for c in steps]
    param_bytes = sum(model.param_bytes(n, choice[n]) for n in st.joint.params.values())
    acc = model.account(choice, recompute)
    return SolveResult(
        choice=dict(choice),
        objective_s=compute + comm + acc.recompute_s,
        compute_s=compute,
        comm_s=comm,
        collectives=tuple(colls),
        param_bytes=param_bytes,
        num_vars=num_vars,
        num_binary=int(sum(model.integer)),
        num_rows=len(model.rows),
        solve_s=solve_s,
        status=status,
        recompute=recompute,
        recompute_s=acc.recompute_s,
        state_bytes=acc.state_bytes,
        activation_bytes=acc.activation_bytes,
        gathered_bytes=acc.gathered_bytes,
        memory_bytes=acc.counted_bytes,
    )


def _closure(roots: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack += n.all_input_nodes
    return seen


def _param_only_nodes(gm: fx.GraphModule, params: set[fx.Node]) -> set[fx.Node]:
    """Nodes computed from parameters alone (the parameters, their casts and views): their
    redistributions run in the stage's UNSHARD, once per step (see autopp.graph.peel)."""
    only: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node in params:
                only.add(node)
        elif node.op == "call_function":
            ins = node.all_input_nodes
            if ins and all(i in only for i in ins):
                only.add(node)
    return only
