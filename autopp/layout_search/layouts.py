"""The layouts a search considers: pp × dp × tp, schedule, stages per rank, microbatches.

:func:`enumerate_layouts` lists every layout of a world size that the schedules can run,
and every one it leaves out with the reason (tp across nodes, a batch dp does not divide,
more stages than layers, a microbatch count the schedule refuses). When nothing is left it
raises one error that says what would work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopp.schedules import microbatches_ok, schedule_info

__all__ = ["DEFAULT_SCHEDULES", "Layout", "enumerate_layouts"]

DEFAULT_SCHEDULES: tuple[str, ...] = (
    "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV", "GPipe")
"""The schedules searched by default (torch's; LoopedBFS is dominated by Interleaved1F1B)."""


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """One way to lay a training step out on the devices."""

    pp: int
    dp: int
    tp: int
    schedule: str
    stages_per_rank: int
    n_microbatches: int

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def __str__(self) -> str:
        v = f" x{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return (f"pp{self.pp} dp{self.dp} tp{self.tp} {self.schedule}{v} "
                f"m{self.n_microbatches}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatch_counts(local: int, n_stages: int, pp: int, schedule: str, limit: int
                       ) -> list[int]:
    """Up to ``limit`` microbatch counts the schedule accepts: from pp (one per pp rank; 1
    without a pipeline) doubling, each dividing the local batch."""
    low = pp  # one microbatch per pp rank fills the pipeline (the schedule may ask more)
    valid = [m for m in _divisors(local) if m >= low
             and microbatches_ok(schedule, pp=pp, n_stages=n_stages, n_microbatches=m)]
    out: list[int] = []
    for m in valid:
        if not out or m >= 2 * out[-1]:
            out.append(m)
        if len(out) == limit:
            break
    return out


def enumerate_layouts(
    *, world_size: int, global_batch: int, n_layers: int, devices_per_node: int,
    schedules: Sequence[str] = DEFAULT_SCHEDULES, tp_sizes: Sequence[int] | None = None,
    pp_sizes: Sequence[int] | None = None, microbatch_choices: int = 3,
    stages_per_rank: Sequence[int] = (2, 3, 4), end_stages: int = 0,
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Every layout of ``world_size`` devices to consider, and (layout family, reason) for
    each one left out.

    ``global_batch``: sequences per step over all dp ranks; ``n_layers``: the repeated
    blocks; ``devices_per_node``: tp stays within a node; ``schedules``, ``tp_sizes`` /
    ``pp_sizes`` (None: every divisor that fits); ``microbatch_choices`` counts per (pp,
    dp, tp, schedule), the fewest that fills the pipeline then doubling; ``stages_per_rank``
    for the looped schedules (the V schedules hold 2); ``end_stages``: how many stages may
    hold no block (1 or 2 when the model has modules before and / or after them), so pp
    goes up to ``n_layers + end_stages``. Raises ValueError when no layout is left, saying
    what would work.
    """
    if world_size < 1 or global_batch < 1:
        raise ValueError(f"world_size and global_batch must be >= 1, got {world_size} and "
                         f"{global_batch}")
    for name in schedules:
        schedule_info(name)  # unknown names fail here, with the list of known ones
    layouts: list[Layout] = []
    rejected: list[tuple[str, str]] = []
    for tp in _divisors(world_size):
        if tp_sizes is not None and tp not in tp_sizes:
            continue
        if tp > devices_per_node:
            rejected.append((f"tp{tp}", f"tp={tp} spans nodes ({devices_per_node} devices "
                                        "per node): tensor parallelism stays in a node"))
            continue
        for pp in _divisors(world_size // tp):
            if pp_sizes is not None and pp not in pp_sizes:
                continue
            dp = world_size // (tp * pp)
            family = f"pp{pp} dp{dp} tp{tp}"
            if pp > n_layers + end_stages:
                rejected.append((family, f"pp={pp} is more than the {_most_stages(n_layers, end_stages)}"))
                continue
            if global_batch % dp:
                rejected.append((family, f"global batch {global_batch} is not divisible by "
                                          f"dp={dp}"))
                continue
            local = global_batch // dp
            for name in schedules if pp > 1 else ("1F1B",):
                info = schedule_info(name)
                v_options = [1]
                if info.multi_stage and pp > 1:
                    hi = info.max_stages_per_rank or max(stages_per_rank)
                    v_options = [v for v in stages_per_rank
                                 if info.min_stages_per_rank <= v <= hi] or [
                        info.default_stages_per_rank]
                for v in v_options:
                    # stages of only the modules before / after the blocks where pp itself
                    # exceeds the blocks; else every stage holds a block
                    if pp * v > n_layers + (end_stages if pp > n_layers else 0):
                        rejected.append((f"{family} {name}{f' x{v}' if v > 1 else ''}",
                                         f"{pp * v} stages is more than the "
                                         f"{_most_stages(n_layers, end_stages if pp > n_layers else 0)}"))
                        continue
                    ms = _microbatch_counts(local, pp * v, pp, name, microbatch_choices)
                    if not ms:
                        rejected.append((f"{family} {name}{f' x{v}' if v > 1 else ''}", (
                            f"{local} sequences per dp rank cannot make the microbatches "
                            f"{name} needs for {pp * v} stages on {pp} ranks")))
                        continue
                    layouts += [Layout(pp, dp, tp, info.name, v, m) for m in ms]
    if not layouts:
        raise ValueError(_nothing_fits(world_size, global_batch, n_layers + end_stages,
                                       devices_per_node,
                                       rejected))
    return layouts, rejected


def _most_stages(n_layers: int, end_stages: int) -> str:
    """The most stages a model can be cut into, said with its reason."""
    if not end_stages:
        return f"model's {n_layers} layers (every stage holds one)"
    return (f"{n_layers + end_stages} stages this model can be cut into ({n_layers} layers, "
            f"and {end_stages} end stage(s) holding only the modules before or after them)")


def _nothing_fits(world_size: int, global_batch: int, most_stages: int, devices_per_node: int,
                  rejected: list[tuple[str, str]]) -> str:
    reasons = "; ".join(f"{f}: {r}" for f, r in rejected[:6])
    more = f" (and {len(rejected) - 6} more)" if len(rejected) > 6 else ""
    works = [w for w in range(max(1, world_size - 64), world_size + 65)
             if any(global_batch % (w // (t * p)) == 0 for t in _divisors(w)
                    if t <= devices_per_node for p in _divisors(w // t) if p <= most_stages
                    and (p == 1 or global_batch // (w // (t * p)) >= p))]
    near = sorted(works, key=lambda w: abs(w - world_size))[:3]
    return (f"no pp x dp x tp layout of {world_size} devices can train a global batch of "
            f"{global_batch} on this model: {reasons}{more}. What would "
            f"work: a global batch divisible by some dp that divides {world_size}, with at "
            f"least pp sequences per dp rank"
            + (f"; or a world size such as {', '.join(map(str, sorted(near)))}" if near else "")
            + ".")
