"""Which pipeline stages each pp rank holds.

Two placements, both torch's own (so that torch's schedule runtime agrees with us):

* ``"loop"``: stage ``s`` on rank ``s % pp``. With pp=2 and 4 stages, rank 0 holds [0, 2] and
  rank 1 holds [1, 3]. Used by GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble.
* ``"v"``: stages go down the ranks and come back up, so the first and last stage share rank
  0. With pp=2 and 4 stages, rank 0 holds [0, 3] and rank 1 holds [1, 2]. Used by
  ZBVZeroBubble and DualPipeV.
"""

from __future__ import annotations

from typing import Literal, get_args

from autopp._compat import pipelining as _torch_compat

#: A stage placement style: "loop" (round robin) or "v" (down the ranks, then back up).
Placement = Literal["loop", "v"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


def check_stage_count(n_stages: int, pp: int) -> None:
    """Raise ValueError unless ``n_stages`` stages can be spread evenly over ``pp`` ranks."""
    if pp < 1:
        raise ValueError(f"pp={pp}: the pipeline needs at least one rank")
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: the pipeline needs at least one stage")
    if n_stages % pp != 0:
        lower, upper = (n_stages // pp) * pp, (n_stages // pp + 1) * pp
        fix = f"n_stages={upper}" if lower == 0 else f"n_stages={lower} or {upper}"
        raise ValueError(
            f"n_stages={n_stages} is not a multiple of pp={pp}: every pp rank must hold the "
            f"same number of stages; use {fix}"
        )


def stage_ids_for_rank(pp_rank: int, pp_size: int, n_stages: int, style: Placement) -> list[int]:
    """The stage indices that pipeline rank ``pp_rank`` holds, in increasing order.

    Args:
        pp_rank: this rank's position along the pipeline (0 .. pp_size-1).
        pp_size: number of pipeline ranks.
        n_stages: number of pipeline stages in total; must be a multiple of ``pp_size``.
        style: ``"loop"`` or ``"v"`` (see the module docstring); a schedule's own style is
            ``schedule_info(name).style``.

    >>> stage_ids_for_rank(0, 2, 4, "loop"), stage_ids_for_rank(0, 2, 4, "v")
    ([0, 2], [0, 3])
    """
    if style not in PLACEMENTS:
        raise ValueError(f"unknown stage placement {style!r}; valid placements are {PLACEMENTS}")
    check_stage_count(n_stages, pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside the pipeline's ranks 0..{pp_size - 1}")
    return sorted(_torch_compat.rank_to_stage_ids(pp_size, n_stages, style)[pp_rank])


def infer_placement(rank_stage_ids: list[list[int]]) -> str:
    """Name the placement of a given stage layout: "loop", "v", or "custom" if neither.

    ``rank_stage_ids[r]`` lists the stages rank r holds. When both styles give the same
    layout (one stage per rank, or pp=1) the answer is "loop".
    """
    pp = len(rank_stage_ids)
    n_stages = sum(len(ids) for ids in rank_stage_ids)
    layout = [sorted(ids) for ids in rank_stage_ids]
    if pp >= 1 and n_stages % pp == 0:
        for style in PLACEMENTS:
            if layout == [stage_ids_for_rank(r, pp, n_stages, style) for r in range(pp)]:
                return style
    return "custom"
