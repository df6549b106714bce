"""A solution of a unit's sharding ILP (:mod:`autopp.sharding.ilp.solver`): what it holds
(:class:`SolveResult`: the choice, its time split, its memory as the row counts it, the
solver's bound; made by ``Model.evaluate``), and the error when no choice satisfies the
constraints."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autopp.sharding.cost.model import Collective
from autopp.sharding.options.strategies import Option


class InfeasiblePlanError(ValueError):
    """No plan: the constraints admit none, or a solve ran out of time before it found one;
    the message says which and names the constraints."""

    @classmethod
    def no_plan(cls, status: str, constraints: list[str], time_limit_s: float
                ) -> InfeasiblePlanError:
        """The error of a solve that returned no plan, from the solver's ``status``: out of
        time is not proven infeasible, and its fix is a longer ``time_limit_s``."""
        if "time limit" in status.lower():
            return cls(f"the solver found no sharding plan within time_limit_s={time_limit_s:g} "
                       f"(solver: {status}); raise time_limit_s. Constraints in force: "
                       f"{constraints}")
        return cls(f"no sharding plan satisfies the constraints together (solver: {status}); "
                   f"constraints in force: {constraints}")


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
    check between the ILP and ``Model.evaluate``) when solved without a memory price."""
    recompute: str = "none"
    recompute_s: float = 0.0
    """Forward time the backward spends recomputing (in :attr:`objective_s`)."""
    state_bytes: float = 0.0
    activation_bytes: float = 0.0
    """Per microbatch, under :attr:`recompute`."""
    gathered_bytes: float = 0.0
    kept_for_w_bytes: float = 0.0
    """Per microbatch, what a split backward keeps from I to W (counted only where the
    memory row has :attr:`~autopp.sharding.ilp.memory_row.MemorySpec.split_in_flight`)."""
    memory_bytes: float = 0.0
    """What the memory row counts for this choice (:class:`MemoryAccount`)."""
    once_comm_s: tuple[float, float] = (0.0, 0.0)
    """(UNSHARD, REDUCE_GRAD) seconds per microbatch of the once-per-step collectives
    (1/M of their time a step; :mod:`autopp.sharding.chain.once_per_step`), at their full time:
    :attr:`objective_s` and :attr:`comm_s` hold them at the model's
    :attr:`~autopp.sharding.ilp.solver.Model.once_weight`, :attr:`collectives` in full."""
    ilp_memory_bytes: float = float("nan")
    """The memory row's value in the solver's solution (equals :attr:`memory_bytes` up to
    tolerances)."""
    bound_s: float = float("nan")
    """A proven lower bound of the solved objective (time + price × counted bytes, in
    seconds, in the ILP's accounting; the LP optimum where the relaxation was integral,
    else the MIP's dual bound); nan where the objective has no time scale (price ``inf``).
    The budget search's bound is built from it (:mod:`autopp.sharding.chain.budget`)."""
    ilp_value_s: float = float("nan")
    """The solver's objective at its solution, at the price solved (compare with
    :attr:`objective_s` + price × :attr:`memory_bytes`: the ILP's memory row and time
    columns may count a little more than ``Model.evaluate``)."""
    memory_bound_bytes: float = float("nan")
    """Of a bytes-only solve (:data:`~autopp.sharding.ilp.solver.BYTES_ONLY`): a proven lower
    bound of the memory row over every plan under the solve's restrictions (the LP
    optimum, or the MIP's dual bound); nan for other solves."""
