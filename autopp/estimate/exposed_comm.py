"""How long a runtime piece (F, I or W of one unit) takes when its collectives overlap its
compute as :func:`autopp.graph.overlap.overlap_collectives` schedules them.

Two streams, as NCCL runs a group's collectives in issue order: compute runs the nodes in
graph order, each once the values it reads are ready (a redistributed value once its last
collective ends); communication runs the collectives in issue order, each once its input is
computed and the collective before it has ended. The piece takes until both are done.
Without overlap (``overlap=False``) every collective is waited at once: the sum.

The sharding ILP prices the sum either way (an upper bound that keeps its objective
linear); the simulator and the dry run take these spans, so the step they report is the
one the overlapped graphs run."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transfer:
    """One collective of a piece: the node whose value it redistributes (None: a value
    ready when the piece starts, e.g. a saved activation or an output gradient), the node
    that reads the result (None: the piece's output, read after the piece), and its time."""

    producer: Hashable | None
    consumer: Hashable | None
    time_s: float
    """A producer outside the piece's nodes is ready when the piece starts."""


@dataclass(frozen=True, slots=True)
class PieceTime:
    """A piece's span and the parts of it."""

    span_s: float
    compute_s: float
    comm_s: float

    @property
    def exposed_comm_s(self) -> float:
        """Communication the compute did not hide."""
        return max(0.0, self.span_s - self.compute_s)

    @property
    def hidden_comm_s(self) -> float:
        return max(0.0, self.comm_s - self.exposed_comm_s)


def piece_time(order: Sequence[Hashable], compute_s: Mapping[Hashable, float],
               reads: Mapping[Hashable, Sequence[Hashable]], transfers: Sequence[Transfer],
               *, overlap: bool = True, lead_s: float = 0.0) -> PieceTime:
    """The span of one piece (module docstring). ``order``: its compute nodes in graph
    order; ``compute_s``: each one's time; ``reads``: the nodes each reads (those outside
    ``order`` are ready at the start); ``transfers``: its collectives in issue order;
    ``lead_s``: compute that runs first (the recomputed forward of a backward piece)."""
    compute = lead_s + sum(compute_s.get(n, 0.0) for n in order)
    comm = sum(t.time_s for t in transfers)
    if not overlap:
        return PieceTime(compute + comm, compute, comm)
    position = {n: i for i, n in enumerate(order)}
    into: dict[Hashable | None, list[Transfer]] = {}
    for t in transfers:
        into.setdefault(t.consumer, []).append(t)
    # the lowered graph issues a node's redistributions where it lowers that node: in the
    # order of their consumers (stable: a chain of collectives on one edge keeps its order)
    pending = sorted(transfers, key=lambda t: position.get(t.consumer, len(order)))
    end: dict[Hashable, float] = {}
    ready: dict[Hashable | None, float] = {}  # consumer -> when its last transfer ends
    comm_free = 0.0
    clock = lead_s
    i = 0

    def issue_until(limit: int) -> None:
        """Issue the transfers whose consumers come before ``order[limit]`` (all of them
        for ``limit == len(order)``): their producers have run."""
        nonlocal i, comm_free
        while i < len(pending) and position.get(pending[i].consumer, len(order)) <= limit:
            t = pending[i]
            start = max(end.get(t.producer, 0.0), comm_free)
            comm_free = start + t.time_s
            ready[t.consumer] = max(ready.get(t.consumer, 0.0), comm_free)
            i += 1

    for k, n in enumerate(order):
        issue_until(k)
        start = max(clock, ready.get(n, 0.0),
                    *(end.get(src, 0.0) for src in reads.get(n, ())))
        clock = end[n] = start + compute_s.get(n, 0.0)
    issue_until(len(order))
    return PieceTime(max(clock, comm_free), compute, comm)
