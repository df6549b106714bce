"""How much memory each planned stage may use: the device's (or a given) budget shared by
the stages of a pp rank, less what the step holds outside the ILP's memory row (the running
action's working memory, :func:`workspace_allowance`; receive buffers, registered buffers,
communicators, the last stage's loss: :func:`fixed_stage_bytes`,
:func:`loss_kept_bytes`, :func:`budgets_less_fixed`), and the activations of the microbatches the schedule keeps in
flight on each stage, read off torch's own action lists."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from autopp.sharding.request import StageMemory


WORKSPACE_SHARE = 1 / 32
"""The largest tensor a planned stage may make and free within one action (an op's output,
a redistributed activation), as a share of the device's usable memory
(``StageMemory.largest_tensor_bytes``); twice it is kept off the budget of each pp rank for
the running action's working memory (an op's input and output, both transient), which the
ILP's row does not count and the simulator counts at the peak. Why a bound: without it the
ILP may gather a large transient (an FFN intermediate, the logits' gradient) over dp to save
parameter memory, since the row sees the memory saved and not the transient paid."""


def workspace_allowance(device_bytes: float) -> tuple[float, float]:
    """(the largest-tensor bound, the bytes kept off a pp rank's budget for the running
    action's working memory) for a device with ``device_bytes`` usable."""
    cap = device_bytes * WORKSPACE_SHARE
    return cap, 2 * cap


@functools.lru_cache(maxsize=1024)
def in_flight_per_stage(schedule: str, pp: int, n_microbatches: int, n_stages: int
                        ) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations the schedule keeps at once, read
    off torch's own action lists (:func:`autopp.schedules.in_flight.max_in_flight`)."""
    from autopp.schedules.actions import compute_order
    from autopp.schedules.in_flight import max_in_flight

    compute, _ = compute_order(schedule, pp=pp, n_microbatches=n_microbatches,
                               n_stages=n_stages)
    return tuple(max(1, k) for k in max_in_flight(compute, n_stages))


@functools.lru_cache(maxsize=1024)
def split_in_flight_per_stage(schedule: str, pp: int, n_microbatches: int, n_stages: int
                              ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, what a split backward holds at its memory peaks as (F->I, I->W)
    microbatch counts (:func:`autopp.schedules.in_flight.split_in_flight`); empty for the
    stages of a schedule whose backwards are whole."""
    from autopp.schedules.actions import compute_order
    from autopp.schedules.in_flight import split_in_flight

    compute, _ = compute_order(schedule, pp=pp, n_microbatches=n_microbatches,
                               n_stages=n_stages)
    return split_in_flight(compute, n_stages)


def memory_budgets(options: Any, profile: Any, schedule: str, pp: int, n_microbatches: int,
                   stage_ranks: Sequence[int]) -> tuple[list[float], list[StageMemory]]:
    """Per stage, the memory budget and the whole-memory accounting the planner uses: the
    device's memory (the profile's, less ``options.memory_reserve``) or
    ``options.memory_budget_bytes``, shared equally by the stages of a pp rank; the
    activations of the microbatches the schedule keeps in flight on the stage
    (:func:`in_flight_per_stage`; with a split backward, the activations up to I and what
    W keeps after it at each of the stage's peaks: :func:`split_in_flight_per_stage`); AdamW's two moments as optimizer state; the recompute
    mode asked for; the working memory of the running action kept off each pp rank's
    budget, and the largest tensor a stage may make bounded (:func:`workspace_allowance`).
    With ``options.parameter_budget_bytes``: that bound on parameter bytes
    alone (shared the same way), nothing else counted, recomputation as asked ("auto":
    none, since nothing counts activations). The whole-memory budgets still include the
    fixed terms; the maker takes them off once the stages' inputs are known
    (:func:`budgets_less_fixed`)."""
    from autopp.profiles import get_profile

    n = len(stage_ranks)
    per_rank = [list(stage_ranks).count(r) for r in stage_ranks]
    # how the stages hold gathered weights and gradients (plan_stage prices and counts it)
    # ("auto": once per step first; autopp.plan.make plans a stage block by block too when
    # that is what fits or is faster)
    gathering = (dict(weight_gathering="per_block", prefetch_blocks=options.prefetch_blocks)
                 if options.weight_gathering == "per_block" else {})
    if options.parameter_budget_bytes is not None:
        mode = "none" if options.recompute == "auto" else options.recompute
        return ([options.parameter_budget_bytes / k for k in per_rank],
                [StageMemory(recompute=mode, **gathering) for _ in range(n)])
    device = (options.memory_budget_bytes if options.memory_budget_bytes is not None
              else get_profile(profile).memory_bytes * (1 - options.memory_reserve))
    in_flight = in_flight_per_stage(schedule, pp, n_microbatches, n)
    cap, working = workspace_allowance(device)
    budgets = [(device - working) / k for k in per_rank]
    split = split_in_flight_per_stage(schedule, pp, n_microbatches, n)
    memory = [StageMemory(activation_factor=float(f), recompute=options.recompute,
                          optimizer_state_factor=2.0, largest_tensor_bytes=cap,
                          split_in_flight=tuple(pairs), **gathering)
              for f, pairs in zip(in_flight, split)]
    return budgets, memory


def fixed_stage_bytes(metas: Sequence[Any], inputs: Sequence[tuple[Any, ...]], *,
                      n_microbatches: int, dp: int, tp: int,
                      bounds: Sequence[str] | None = None) -> list[int]:
    """Per stage, the bytes it holds for the whole step outside what the ILP counts: its
    receive buffers (:func:`autopp.schedules.memory_terms.stage_receive_bytes`) and its
    registered buffers (:func:`~autopp.schedules.memory_terms.module_buffer_bytes`).
    ``metas``: the stages on meta; ``inputs``: each stage's dp-global microbatch inputs;
    ``bounds``: the boundary placements (``bounds[s]`` into stage ``s``, as
    :func:`autopp.plan.make.plan_boundaries` returns them). Without ``bounds`` every
    boundary is counted at "batch", the largest kind (tp-replicated: tp times a
    "batch+seq" boundary's bytes)."""
    from autopp.plan.objective import boundary_bytes
    from autopp.schedules.memory_terms import module_buffer_bytes, stage_receive_bytes

    n = len(metas)
    kind = (lambda s: "batch") if bounds is None else (lambda s: bounds[s + 1])
    send = [boundary_bytes(inputs[s + 1][0], dp, tp, kind(s)) if s + 1 < n else 0
            for s in range(n)]
    recv = stage_receive_bytes(n_microbatches, send)
    return [r + module_buffer_bytes(m) for r, m in zip(recv, metas)]


def budgets_less_fixed(budgets: Sequence[float], fixed: Sequence[int], communicators: int,
                       stage_ranks: Sequence[int]) -> list[float]:
    """The per-stage budgets the ILP plans under, once the fixed terms are taken off: a
    stage's own (:func:`fixed_stage_bytes`) and its share of its rank's communicators
    (:func:`autopp.schedules.memory_terms.communicator_bytes`), shared equally by the
    rank's stages as the budget is."""
    per_rank = [list(stage_ranks).count(r) for r in stage_ranks]
    return [b - f - communicators / k for b, f, k in zip(budgets, fixed, per_rank)]


def loss_kept_bytes(logits: Any, dp: int, tp: int, kinds: Sequence[str], in_flight: float
                    ) -> int:
    """The last stage's loss's bytes per device that the ILP's row does not count (its
    graph ends at the logits): :func:`autopp.sharding.cost.loss.cross_entropy_kept_bytes`
    × the microbatches in flight on it, at the smallest of the loss placements compared
    (``kinds``: "vocab" splits the logits over tp as well as dp), so no choice is refused
    for a term it would not hold. ``logits``: the dp-global microbatch's, on meta."""
    from autopp.sharding.cost.loss import cross_entropy_kept_bytes

    if not (logits.is_floating_point() and logits.ndim >= 2):
        return 0
    split = max(dp * (tp if k == "vocab" else 1) for k in kinds)
    return int(in_flight * cross_entropy_kept_bytes(logits.numel() // split,
                                                    logits.element_size()))
