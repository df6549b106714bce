"""What the schedule simulator returns (:class:`SimulationResult` and its parts), as values.

Times are seconds from the start of the step; memory is bytes on one device of a pp rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopp.schedules.actions import ScheduleActions

#: Memory categories, in the order results list them.
MEMORY_CATEGORIES: tuple[str, ...] = (
    "parameters", "gradients", "optimizer", "gathered_parameters", "activations",
    "workspace", "buffers", "receive_buffers", "communicators",
)
COMPUTE_KINDS: frozenset[str] = frozenset({"F", "B", "I", "W"})
"""Action kinds that are compute; UNSHARD and REDUCE_GRAD also occupy the rank (see busy)."""
COMM_KINDS: frozenset[str] = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
"""Point-to-point actions: they cost the rank no time and run beside its compute."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one rank by category."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    gathered_parameters: int = 0
    activations: int = 0
    workspace: int = 0
    """The running compute action's working memory (its graph's intermediates and fresh
    gradients), held during the action only."""
    buffers: int = 0
    """The stages' registered buffers (e.g. RoPE tables), held all step."""
    receive_buffers: int = 0
    """torch's preallocated p2p receive buffers, held all step
    (:func:`autopp.schedules.memory_terms.receive_buffer_bytes`)."""
    communicators: int = 0
    """The rank's process groups' communicator allowance, held all step."""

    @property
    def total(self) -> int:
        """Sum of all categories."""
        return sum(getattr(self, c) for c in MEMORY_CATEGORIES)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionEvent:
    """One action as the simulator ran it."""

    rank: int
    """The pp rank that ran it."""
    action: str
    """torch's action string, e.g. "2F0", "1SEND_B3", "0UNSHARD"."""
    kind: str
    """"F", "B", "I", "W", "UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F",
    "SEND_B" or "RECV_B"."""
    stage: int
    """The stage it belongs to."""
    microbatch: int | None
    """The microbatch, None for UNSHARD / RESHARD / REDUCE_GRAD."""
    start_s: float
    """Start time from the beginning of the step. For a SEND: when the rank issued it; for a
    RECV: when the data started to arrive (or the RECV was posted, if later)."""
    end_s: float
    """End time; for SEND and RECV, the arrival of the data."""
    overlapped: bool = False
    """True for the halves of a DualPipeV OVERLAP_F_B step."""
    peer_rank: int | None = None
    """For SEND / RECV: the other rank."""
    nbytes: int = 0
    """For SEND / RECV: the bytes transferred."""

    @property
    def lane(self) -> str:
        """"comm" for SEND / RECV (they run beside compute), else "compute"."""
        return "comm" if self.kind in COMM_KINDS else "compute"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryTimeline:
    """One rank's memory over the step: a step function of time per category."""

    rank: int
    times_s: tuple[float, ...]
    """Times at which memory changes (the first is 0)."""
    bytes: Mapping[str, tuple[int, ...]]
    """``bytes[category][i]``: bytes held from ``times_s[i]`` until ``times_s[i + 1]``, for
    each category of :data:`MEMORY_CATEGORIES`."""

    def total(self) -> tuple[int, ...]:
        """Bytes held over all categories, at each of ``times_s``."""
        return tuple(sum(col) for col in zip(*(self.bytes[c] for c in MEMORY_CATEGORIES)))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSummary:
    """One pp rank's time and memory over the step."""

    rank: int
    stages: tuple[int, ...]
    """The stages it holds."""
    busy_s: float
    """Time running actions: compute (F, B, I, W), plus UNSHARD and REDUCE_GRAD where they
    block the rank (not issued ahead, ``StageCost.collectives_ahead``)."""
    compute_s: float
    """Time running F, B, I and W only."""
    idle_s: float
    """``step_time_s - busy_s``: waiting for data, or done before the slowest rank."""
    bubble_fraction: float
    """``idle_s / step_time_s``."""
    first_start_s: float
    """Start of its first busy action."""
    last_end_s: float
    """End of its last busy action."""
    peak_bytes: int
    """Highest total memory over the step."""
    memory_at_peak: MemoryBreakdown
    """Each category's bytes at the moment of the highest total."""
    peak_by_category: MemoryBreakdown
    """Each category's own highest value over the step."""

    @property
    def idle_in_span_s(self) -> float:
        """Idle time between its first and last busy action (the bubble when consecutive
        steps overlap, as zero-bubble papers count it)."""
        return (self.last_end_s - self.first_start_s) - self.busy_s


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """The simulated training step of one pipeline."""

    actions: ScheduleActions
    """The schedule that ran (its name, sizes and action lists)."""
    step_time_s: float
    """Time from the first action to the end of the last rank (makespan)."""
    ranks: tuple[RankSummary, ...]
    """Per pp rank, in rank order."""
    events: tuple[ActionEvent, ...]
    """Every action of every rank, ranks in order, each rank's in run order."""
    memory: tuple[MemoryTimeline, ...]
    """Per pp rank, memory over time."""
    max_in_flight: tuple[int, ...]
    """Per stage: most microbatches whose activations were held at the same time."""

    def check_placement(self, stage_ranks) -> SimulationResult:
        """This result, when its schedule placed stage ``s`` on pp rank ``stage_ranks[s]``
        as the pipeline does; a RuntimeError (a bug: the two placements must agree)
        otherwise."""
        if self.actions.stage_to_rank != tuple(stage_ranks):
            raise RuntimeError(f"simulated stage placement {self.actions.stage_to_rank} "
                               f"differs from the pipeline's {tuple(stage_ranks)}")
        return self

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``sum(idle_s) / (pp * step_time_s)``."""
        if self.step_time_s == 0:
            return 0.0
        return sum(r.idle_s for r in self.ranks) / (len(self.ranks) * self.step_time_s)

    def format(self) -> str:
        """A short printable report: step time, then one line per rank."""
        a = self.actions
        gib = float(2**30)
        lines = [
            f"{a.name}: pp={a.pp}, {a.n_stages} stages, {a.n_microbatches} microbatches: "
            f"step {self.step_time_s * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%}",
        ]
        for r in self.ranks:
            p = r.memory_at_peak
            lines.append(
                f"  rank {r.rank} stages {list(r.stages)}: busy {r.busy_s * 1e3:.3f} ms, "
                f"bubble {r.bubble_fraction:.1%}, peak {r.peak_bytes / gib:.3f} GiB "
                f"(params {p.parameters / gib:.3f}, grads {p.gradients / gib:.3f}, "
                f"optim {p.optimizer / gib:.3f}, gathered {p.gathered_parameters / gib:.3f}, "
                f"acts {p.activations / gib:.3f}, work {p.workspace / gib:.3f}, "
                f"buffers {p.buffers / gib:.3f}, "
                f"recv {p.receive_buffers / gib:.3f}, comm {p.communicators / gib:.3f}), "
                "in flight "
                + ", ".join(f"s{s}:{self.max_in_flight[s]}" for s in r.stages)
            )
        return "\n".join(lines)
