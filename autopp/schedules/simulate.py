"""A discrete-event simulator of pipeline schedules: step time, bubbles and memory per rank.

It runs the action lists torch's runtime runs (:mod:`autopp.schedules.actions`) with one
:class:`StageCost` per stage and :class:`Link` models, by the rules of torch's runtime: each
rank runs its list in order; a compute action waits for its input (the producer on the same
rank, else the transfer's arrival); sends cost the rank nothing, occupy their directed link
for bytes / bandwidth and arrive latency later; a step ends when the sends have arrived;
OVERLAP_F_B runs its halves in turn. UNSHARD and REDUCE_GRAD block, unless issued ahead
(``collectives_ahead``): they then run on the rank's communication stream, and the stage's
next action, or the step's end, waits for them.

Memory per rank by category: parameters, optimizer state and fixed terms all step; gradients
unreduced until REDUCE_GRAD; gathered weights from UNSHARD to RESHARD; activations from F to
B (split backward: what W keeps, I to W); workspace while an action runs. Not modelled: sent
tensors held to the step's end, collectives' working memory, fragmentation, contention."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from autopp._compat import pipelining as _torch_compat
from autopp.schedules.actions import ScheduleActions, schedule_actions
from autopp.schedules.memory_terms import stage_receive_bytes
from autopp.schedules.registry import ScheduleInfo
from autopp.schedules.sim_result import (
    COMM_KINDS,
    COMPUTE_KINDS,
    MEMORY_CATEGORIES,
    ActionEvent,
    MemoryBreakdown,
    MemoryTimeline,
    RankSummary,
    SimulationResult,
)

__all__ = [
    "COMM_KINDS", "COMPUTE_KINDS", "MEMORY_CATEGORIES", "ActionEvent", "Link",
    "MemoryBreakdown", "MemoryTimeline", "RankSummary", "SimulationResult", "StageCost",
    "simulate", "simulate_schedule",
]

(_PARAMS, _GRADS, _OPT, _GATHERED, _ACTS, _WORK, _BUFS, _RECV,
 _COMM) = range(len(MEMORY_CATEGORIES))

_NOT_WAITING = ("UNSHARD", "SEND_F", "SEND_B", "RECV_F", "RECV_B")
"""Actions that do not wait for their stage's gathers in flight (the runtime waits before
the stage's compute, RESHARD and REDUCE_GRAD; torch runs the sends and receives itself)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCost:
    """What one pipeline stage costs, per microbatch and per step. Times in seconds, sizes in
    bytes, all per device of the stage (one pp rank holds one device's share)."""

    forward_s: float
    """Time of the stage's forward on one microbatch (F)."""
    backward_input_s: float
    """Time of the backward for the stage's inputs on one microbatch (I): what the previous
    stage waits for."""
    backward_weight_s: float
    """Time of the backward for the stage's weights on one microbatch (W), which zero-bubble
    schedules defer."""
    backward_s: float | None = None
    """Time of the full backward (B) on one microbatch, for schedules that do not split it;
    None: ``backward_input_s + backward_weight_s``."""
    unshard_s: float = 0.0
    """Time of one UNSHARD: gathering the stage's sharded parameters (once per step)."""
    collectives_ahead: bool = False
    """UNSHARD and REDUCE_GRAD run in the background (``StageGraphs.collectives_ahead``):
    the rank goes on with its next actions, the stage's own next action waits for its
    gathers, and the step's end for its reductions. False: each occupies the rank for its
    time."""
    reduce_grad_s: float = 0.0
    """Time of the REDUCE_GRAD after the stage's last backward (reducing gradients over dp)."""
    activation_bytes_per_microbatch: int = 0
    """Bytes the forward saves for the backward, per microbatch (held from F to backward)."""
    activation_bytes_kept_for_w: int | None = None
    """With a split backward: bytes still held from the end of I to the end of W (the saved
    inputs of the weight matmuls plus the output gradients W reads). None: all of
    ``activation_bytes_per_microbatch`` (nothing is freed before W, the conservative
    default); 0: everything is freed at I. It may exceed the activation bytes."""
    p2p_bytes_per_microbatch: int = 0
    """Bytes of the stage's output sent to the next stage per microbatch; the gradient the
    next stage sends back has the same size."""
    param_bytes: int = 0
    """Bytes of the stage's parameters as stored on the device (sharded), held all step."""
    grad_bytes: int = 0
    """Bytes of the stage's gradients after REDUCE_GRAD (sharded as the parameters)."""
    unreduced_grad_bytes: int | None = None
    """Bytes of the gradients accumulated between the first backward and REDUCE_GRAD (e.g.
    unsharded gradients before a reduce-scatter); None: ``grad_bytes``."""
    optimizer_bytes: int = 0
    """Bytes of optimizer state, held all step (AdamW: fp32 master weights, when training in
    lower precision, plus two fp32 moments, sharded as the parameters)."""
    gathered_param_bytes: int = 0
    """Bytes of the parameters gathered by UNSHARD, held until RESHARD."""
    buffer_bytes: int = 0
    """Bytes of the stage's registered buffers (e.g. RoPE tables), held all step."""
    forward_workspace_bytes: int = 0
    """Working memory of one F above what it keeps (its graph's intermediates), held while
    it runs (:func:`autopp.lower.memory.action_workspace_bytes`)."""
    backward_workspace_bytes: int = 0
    """Working memory of one B (intermediates, fresh gradients, the input gradient)."""
    backward_input_workspace_bytes: int = 0
    """Working memory of one I."""
    backward_weight_workspace_bytes: int = 0
    """Working memory of one W."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(
                    f"StageCost.{f.name}={value!r}: must be a finite number >= 0"
                )

    @staticmethod
    def thirds(per_microbatch_s: float, recompute_s: float = 0.0) -> tuple[float, float, float]:
        """(F, I, W) of a stage whose split into pieces is not read off graphs: a third
        each of the per-microbatch time without recomputation, I re-running the recomputed
        forward (``recompute_s``, part of ``per_microbatch_s``)."""
        base = max(per_microbatch_s - recompute_s, 0.0) / 3
        return base, base + recompute_s, base

    @property
    def full_backward_s(self) -> float:
        """Time of a full backward B."""
        if self.backward_s is not None:
            return self.backward_s
        return self.backward_input_s + self.backward_weight_s

    @property
    def kept_for_w_bytes(self) -> int:
        """Bytes held from the end of I to the end of W (see activation_bytes_kept_for_w)."""
        if self.activation_bytes_kept_for_w is None:
            return self.activation_bytes_per_microbatch
        return self.activation_bytes_kept_for_w

    @property
    def accumulating_grad_bytes(self) -> int:
        """Bytes of gradients held before REDUCE_GRAD."""
        return self.grad_bytes if self.unreduced_grad_bytes is None else self.unreduced_grad_bytes


@dataclass(frozen=True, slots=True)
class Link:
    """A point-to-point link between two pp ranks: a transfer of n bytes takes
    ``latency_s + n / bandwidth_bytes_per_s``, and transfers on one directed link share its
    bandwidth one after the other."""

    latency_s: float = 0.0
    """Seconds from the start of a transfer to the arrival of its first byte."""
    bandwidth_bytes_per_s: float = math.inf
    """Bytes per second; inf for no bandwidth limit."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"Link.latency_s={self.latency_s!r}: must be finite and >= 0")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"Link.bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r}: must be > 0 "
                "(math.inf for no limit)"
            )

    def occupancy_s(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` keeps the link busy (nbytes / bandwidth)."""
        return nbytes / self.bandwidth_bytes_per_s


def _stage_costs(costs: StageCost | Sequence[StageCost], n_stages: int) -> list[StageCost]:
    if isinstance(costs, StageCost):
        return [costs] * n_stages
    costs = list(costs)
    if len(costs) != n_stages or not all(isinstance(c, StageCost) for c in costs):
        raise ValueError(
            f"costs must be one StageCost (the same for every stage) or a list of {n_stages} "
            f"StageCost, one per stage; got {len(costs)} items"
        )
    return costs


#: One step of a rank's list: kind, stage, microbatch, action string, half of an OVERLAP_F_B.
_Op = tuple[str, int, int | None, str, bool]


_OPS_CACHE: dict[int, tuple[ScheduleActions, list[list[_Op]]]] = {}


def _ops(actions: ScheduleActions) -> list[list[_Op]]:
    """Each rank's steps (cached per action-list object: the named schedules' are)."""
    hit = _OPS_CACHE.get(id(actions))
    if hit is not None and hit[0] is actions:
        return hit[1]
    if len(_OPS_CACHE) > 512:
        _OPS_CACHE.clear()
    out: list[list[_Op]] = []
    for row in actions.lowered:
        ops: list[_Op] = []
        for text in row:
            parts = _torch_compat.action_parts(text)
            overlapped = len(parts) > 1
            for stage, kind, mb in parts:
                label = text if not overlapped else f"{stage}{kind}{mb}"
                ops.append((kind, stage, mb, label, overlapped))
        out.append(ops)
    _OPS_CACHE[id(actions)] = (actions, out)
    return out


def simulate(
    actions: ScheduleActions,
    costs: StageCost | Sequence[StageCost],
    *,
    link: Link = Link(),
    links: Mapping[tuple[int, int], Link] | None = None,
    communicator_bytes: int = 0,
) -> SimulationResult:
    """Simulate one training step of ``actions`` (see :func:`schedule_actions`).

    Args:
        actions: every rank's action list.
        costs: one StageCost for every stage, or a list with one per stage (index = stage).
        link: the link between any two pp ranks.
        links: links that differ, by (sending rank, receiving rank).
        communicator_bytes: what each rank's process groups hold
            (:func:`~autopp.schedules.memory_terms.communicator_bytes`).

    Raises ValueError if ``costs`` does not match the stages, or if the lists deadlock
    (which torch's validator should have prevented), naming each blocked rank's next action.
    """
    # 1. Inputs: each rank's list as (kind, stage, microbatch) steps, OVERLAP_F_B split in two.
    n_stages, pp = actions.n_stages, actions.pp
    cost = _stage_costs(costs, n_stages)
    rank_of = actions.stage_to_rank
    last = n_stages - 1
    links = dict(links or {})
    ops = _ops(actions)

    # 2. State. A dependency is a key -> the time it is met: ("F", s, mb) / ("Bi", s, mb) the
    # end of F / of B or I on the same rank, ("XF", s, mb) / ("XB", s, mb) the arrival of the
    # activation / gradient that stage s sent. A rank blocked on a key waits in `waiters`.
    clock = [0.0] * pp              # when each rank's stream is free
    send_end = [0.0] * pp           # latest arrival of each rank's sends
    comm_free = [0.0] * pp          # when each rank's communication stream is free
    gathered: dict[int, float] = {}  # stage -> end of its UNSHARD issued ahead, until waited
    busy = [0.0] * pp
    compute = [0.0] * pp
    first = [math.inf] * pp
    done: dict[tuple, float] = {}   # resolved dependencies -> time
    transfers: dict[tuple, tuple[float, float]] = {}  # (kind, src stage, mb) -> (start, arrival)
    waiters: dict[tuple, list[int]] = {}
    link_free: dict[tuple[int, int], float] = {}
    events: list[list[ActionEvent | None]] = [[] for _ in range(pp)]
    recvs: list[tuple[int, int, tuple, float, int]] = []  # rank, event index, key, post, peer
    mem: list[list[tuple[float, int, int]]] = [[] for _ in range(pp)]  # time, category, delta
    alive: list[list[tuple[float, int]]] = [[] for _ in range(n_stages)]  # in-flight changes
    grads_started: set[int] = set()
    pos = [0] * pp
    queue = deque(range(pp))
    queued = [True] * pp

    def resolve(key: tuple, time: float) -> None:
        done[key] = time
        for r in waiters.pop(key, ()):
            if not queued[r]:
                queued[r] = True
                queue.append(r)

    def dependency(kind: str, s: int, mb: int | None, r: int) -> tuple | None:
        """The key step (kind, s, mb) on rank r waits for; None if it waits for nothing."""
        if kind == "F" and s > 0:
            return ("F", s - 1, mb) if rank_of[s - 1] == r else ("XF", s - 1, mb)
        if kind in ("B", "I"):
            if s == last:
                return ("F", s, mb)
            return ("Bi", s + 1, mb) if rank_of[s + 1] == r else ("XB", s + 1, mb)
        if kind == "W":
            return ("Bi", s, mb)
        return None

    # 3. Run every rank as far as its dependencies allow; a met dependency requeues its
    # waiters. Times come from the dependencies, so the order ranks are visited in does not
    # matter (each directed link has one sender, whose sends are visited in its own order).
    while queue:
        r = queue.popleft()
        queued[r] = False
        row = ops[r]
        while pos[r] < len(row):
            kind, s, mb, label, overlapped = row[pos[r]]
            key = dependency(kind, s, mb, r)
            if key is not None and key not in done:
                waiters.setdefault(key, []).append(r)
                break
            c = cost[s]
            start = max(clock[r], done[key]) if key is not None else clock[r]
            if s in gathered and kind not in _NOT_WAITING:  # its gathers, issued ahead
                start = max(start, gathered.pop(s))
            duration = 0.0
            work = _workspace(c, kind)
            if work:
                mem[r].append((start, _WORK, work))
            if kind == "F":
                duration = c.forward_s
                mem[r].append((start, _ACTS, c.activation_bytes_per_microbatch))
                alive[s].append((start, 1))
            elif kind in ("B", "I", "W"):
                duration = {"B": c.full_backward_s, "I": c.backward_input_s,
                            "W": c.backward_weight_s}[kind]
                if kind != "I" and s not in grads_started:
                    grads_started.add(s)
                    mem[r].append((start, _GRADS, c.accumulating_grad_bytes))
            elif kind in ("UNSHARD", "REDUCE_GRAD") and c.collectives_ahead:
                # on the rank's communication stream, one after another; the rank goes on
                t0 = max(start, comm_free[r])
                end = comm_free[r] = t0 + (c.unshard_s if kind == "UNSHARD" else
                                           c.reduce_grad_s)
                if kind == "UNSHARD":
                    mem[r].append((start, _GATHERED, c.gathered_param_bytes))
                    gathered[s] = end
                else:
                    mem[r].append((end, _GRADS, c.grad_bytes - c.accumulating_grad_bytes))
                events[r].append(ActionEvent(
                    rank=r, action=label, kind=kind, stage=s, microbatch=mb, start_s=t0,
                    end_s=end, overlapped=True))
                pos[r] += 1
                continue
            elif kind == "UNSHARD":
                mem[r].append((start, _GATHERED, c.gathered_param_bytes))
                duration = c.unshard_s
            elif kind == "RESHARD":
                mem[r].append((start, _GATHERED, -c.gathered_param_bytes))
            elif kind == "REDUCE_GRAD":
                duration = c.reduce_grad_s
            elif kind in ("SEND_F", "SEND_B"):
                forward = kind == "SEND_F"
                peer = rank_of[s + 1] if forward else rank_of[s - 1]
                nbytes = cost[s].p2p_bytes_per_microbatch if forward else (
                    cost[s - 1].p2p_bytes_per_microbatch)
                lk = links.get((r, peer), link)
                t0 = max(start, link_free.get((r, peer), 0.0))
                link_free[(r, peer)] = t0 + lk.occupancy_s(nbytes)
                arrival = t0 + lk.occupancy_s(nbytes) + lk.latency_s
                xkey = ("XF" if forward else "XB", s, mb)
                transfers[xkey] = (t0, arrival)
                send_end[r] = max(send_end[r], arrival)
                events[r].append(ActionEvent(
                    rank=r, action=label, kind=kind, stage=s, microbatch=mb, start_s=start,
                    end_s=arrival, peer_rank=peer, nbytes=nbytes))
                resolve(xkey, arrival)
                pos[r] += 1
                continue
            elif kind in ("RECV_F", "RECV_B"):
                forward = kind == "RECV_F"
                peer = rank_of[s - 1] if forward else rank_of[s + 1]
                xkey = ("XF", s - 1, mb) if forward else ("XB", s + 1, mb)
                recvs.append((r, len(events[r]), xkey, start, peer))
                events[r].append(None)  # filled in once the matching send has run
                pos[r] += 1
                continue
            else:
                raise ValueError(f"rank {r}: action {label!r} of kind {kind!r} is not simulated")

            end = start + duration
            clock[r] = end
            busy[r] += duration
            if kind in COMPUTE_KINDS:
                compute[r] += duration
            if duration > 0 or kind in COMPUTE_KINDS:
                first[r] = min(first[r], start)
            # frees and completions
            if work:
                mem[r].append((end, _WORK, -work))
            if kind == "B":
                mem[r].append((end, _ACTS, -c.activation_bytes_per_microbatch))
                alive[s].append((end, -1))
            elif kind == "I":
                kept = c.kept_for_w_bytes
                mem[r].append((end, _ACTS, kept - c.activation_bytes_per_microbatch))
                if kept == 0:
                    alive[s].append((end, -1))
            elif kind == "W":
                kept = c.kept_for_w_bytes
                mem[r].append((end, _ACTS, -kept))
                if kept != 0:
                    alive[s].append((end, -1))
            elif kind == "REDUCE_GRAD":
                mem[r].append((end, _GRADS, c.grad_bytes - c.accumulating_grad_bytes))
            events[r].append(ActionEvent(
                rank=r, action=label, kind=kind, stage=s, microbatch=mb, start_s=start,
                end_s=end, overlapped=overlapped))
            pos[r] += 1
            if kind == "F":
                resolve(("F", s, mb), end)
            elif kind in ("B", "I"):
                resolve(("Bi", s, mb), end)

    blocked = [r for r in range(pp) if pos[r] < len(ops[r])]
    if blocked:
        detail = "; ".join(f"rank {r} at {ops[r][pos[r]][3]!r} (step {pos[r]})" for r in blocked)
        raise ValueError(
            f"schedule {actions.name!r} deadlocks: {detail}; every compute step needs its "
            "input from the neighbouring stage to be computed earlier in some rank's list"
        )

    # 4. RECV events, now that every transfer is known; then per-rank summaries.
    for r, index, xkey, post, peer in recvs:
        t0, arrival = transfers[xkey]
        stage = xkey[1] + 1 if xkey[0] == "XF" else xkey[1] - 1
        kind = "RECV_F" if xkey[0] == "XF" else "RECV_B"
        events[r][index] = ActionEvent(
            rank=r, action=f"{stage}{kind}{xkey[2]}", kind=kind, stage=stage,
            microbatch=xkey[2], start_s=max(post, t0), end_s=max(post, arrival),
            peer_rank=peer, nbytes=cost[min(stage, xkey[1])].p2p_bytes_per_microbatch)

    step = max(max(clock), max(send_end), max(comm_free)) if pp else 0.0
    receive = stage_receive_bytes(actions.n_microbatches,
                                  [c.p2p_bytes_per_microbatch for c in cost[:last]] + [0])
    memory, summaries = [], []
    for r in range(pp):
        stages = tuple(actions.stage_ids(r))
        static = [0] * len(MEMORY_CATEGORIES)
        static[_PARAMS] = sum(cost[s].param_bytes for s in stages)
        static[_OPT] = sum(cost[s].optimizer_bytes for s in stages)
        static[_BUFS] = sum(cost[s].buffer_bytes for s in stages)
        static[_RECV] = sum(receive[s] for s in stages)
        static[_COMM] = communicator_bytes if stages else 0
        timeline = _timeline(r, static, mem[r])
        memory.append(timeline)
        totals = timeline.total()
        at = max(range(len(totals)), key=totals.__getitem__)
        idle = step - busy[r]
        summaries.append(RankSummary(
            rank=r, stages=stages, busy_s=busy[r], compute_s=compute[r], idle_s=idle,
            bubble_fraction=idle / step if step > 0 else 0.0,
            first_start_s=first[r] if first[r] < math.inf else 0.0, last_end_s=clock[r],
            peak_bytes=totals[at],
            memory_at_peak=MemoryBreakdown(
                **{c: timeline.bytes[c][at] for c in MEMORY_CATEGORIES}),
            peak_by_category=MemoryBreakdown(
                **{c: max(timeline.bytes[c]) for c in MEMORY_CATEGORIES}),
        ))
    return SimulationResult(
        actions=actions,
        step_time_s=step,
        ranks=tuple(summaries),
        events=tuple(e for row in events for e in row if e is not None),
        memory=tuple(memory),
        max_in_flight=tuple(_max_alive(changes) for changes in alive),
    )


def _workspace(c: StageCost, kind: str) -> int:
    """The working memory of a compute action of kind ``kind`` on the stage costing ``c``."""
    if kind == "F":
        return c.forward_workspace_bytes
    if kind == "B":
        return c.backward_workspace_bytes
    if kind == "I":
        return c.backward_input_workspace_bytes
    if kind == "W":
        return c.backward_weight_workspace_bytes
    return 0


def _timeline(rank: int, static: list[int], changes: list[tuple[float, int, int]]
              ) -> MemoryTimeline:
    """Step function from (time, category, delta) changes; frees before allocations at the
    same time, and one point per distinct time."""
    current = list(static)
    times = [0.0]
    values = [tuple(current)]
    for time, category, delta in sorted(changes, key=lambda x: (x[0], x[2])):
        current[category] += delta
        if time == times[-1]:
            values[-1] = tuple(current)
        else:
            times.append(time)
            values.append(tuple(current))
    columns = list(zip(*values))
    return MemoryTimeline(
        rank=rank, times_s=tuple(times),
        bytes={c: tuple(columns[i]) for i, c in enumerate(MEMORY_CATEGORIES)},
    )


def _max_alive(changes: list[tuple[float, int]]) -> int:
    count = best = 0
    for _, delta in sorted(changes):  # at equal times, -1 (free) sorts before +1
        count += delta
        best = max(best, count)
    return best


def simulate_schedule(
    schedule: str | os.PathLike | ScheduleInfo | ScheduleActions,
    costs: StageCost | Sequence[StageCost],
    *,
    pp: int | None = None,
    n_microbatches: int | None = None,
    n_stages: int | None = None,
    link: Link = Link(),
    links: Mapping[tuple[int, int], Link] | None = None,
    communicator_bytes: int = 0,
) -> SimulationResult:
    """Simulate one training step of a schedule given by name, CSV path or action lists.

    Args:
        schedule: a name from ``SCHEDULE_NAMES``, a compute-only CSV path, a ``ScheduleInfo``,
            or a ``ScheduleActions`` (then pp, n_microbatches, n_stages must be None).
        costs: one StageCost for every stage, or a list with one per stage.
        pp, n_microbatches: required for a name (a CSV file fixes its own).
        n_stages: stages in total; default pp for GPipe / 1F1B, 2 * pp for the others.
        link: the link between any two pp ranks (default instantaneous); links: those that
            differ, by (sending rank, receiving rank).
        communicator_bytes: what each rank's process groups hold (see :func:`simulate`).

    Example: ``simulate_schedule("1F1B", StageCost(forward_s=1, backward_input_s=1,
    backward_weight_s=1), pp=4, n_microbatches=8).bubble_fraction`` is 3 / 11."""
    if isinstance(schedule, ScheduleActions):
        if (pp, n_microbatches, n_stages) != (None, None, None):
            raise ValueError(
                "pass pp, n_microbatches and n_stages only with a schedule name; a "
                "ScheduleActions already fixes them"
            )
        actions = schedule
    else:
        actions = schedule_actions(schedule, pp=pp, n_microbatches=n_microbatches,
                                   n_stages=n_stages)
    return simulate(actions, costs, link=link, links=links,
                    communicator_bytes=communicator_bytes)
