"""The one place where autopp's schedules touch private parts of torch.distributed.pipelining.

Everything here wraps an underscore name of torch 2.13 (``_PipelineScheduleRuntime``,
``_Action``, ``_validate_schedule``, ``_load_csv``, the stage-to-rank mapping helpers of
``_utils``). The rest of ``autopp.schedules`` sees only plain Python values: a schedule's
order is ``dict[rank, list[str | None]]`` with torch's compact action strings ("0F0", "1B0",
"0I0", "0W0", "(0F3;3B1)OVERLAP_F_B") and ``None`` for an idle step. It also holds the one
override of ``PipelineStage``'s private first-step shape inference that the stage backends
use (:func:`pipeline_stage_with_inference_context`). A torch upgrade that renames or moves
any of these should need changes in this file only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

#: torch's schedule class that runs any action list: the class a CSV-defined schedule becomes.
RUNTIME_SCHEDULE_CLASS: type = _schedules._PipelineScheduleRuntime

#: Compute action types a compute-only schedule may hold (forward, full backward, backward for
#: inputs, backward for weights, and a forward overlapped with a backward).
COMPUTE_TYPES: frozenset[str] = frozenset({"F", "B", "I", "W", "OVERLAP_F_B"})

#: One compute step in plain values: (stage index, action type, microbatch index).
ComputePart = tuple[int, str, int | None]


def _parse(text: str) -> Any:
    """torch's ``_Action`` for ``text`` (``None`` for an empty cell); ValueError if malformed."""
    try:
        return _schedules._Action.from_str(text)
    except RuntimeError as exc:  # torch reports a malformed action string as RuntimeError
        raise ValueError(str(exc)) from exc


def compute_parts(text: str) -> list[ComputePart] | None:
    """The compute steps written as ``text``; ``None`` for an idle step (empty cell).

    An overlapped action such as "(0F3;3B1)OVERLAP_F_B" gives its two sub-steps. Raises
    ValueError for a malformed string or a non-compute action (SEND_F, UNSHARD, ...).
    """
    action = _parse(text)
    if action is None:
        return None
    kind = action.computation_type.value
    if kind not in COMPUTE_TYPES:
        raise ValueError(
            f"action {text.strip()!r} is not a compute action; a compute-only schedule holds "
            f"only {sorted(COMPUTE_TYPES)} (communication is added by torch's runtime)"
        )
    if action.sub_actions is not None:
        return [
            (sub.stage_index, sub.computation_type.value, sub.microbatch_index)
            for sub in action.sub_actions
        ]
    return [(action.stage_index, kind, action.microbatch_index)]


def validate_compute_order(
    order: dict[int, Sequence[str | None]], *, pp: int, n_stages: int, n_microbatches: int
) -> dict[int, int]:
    """Check ``order`` with torch's own schedule validator; returns stage index -> pp rank.

    torch checks that every rank has a row, every stage runs each microbatch's forward once and
    its backward once (B, or I then W), in dependency order, and that no stage sits on two
    ranks. Its AssertionError comes back as ValueError.
    """
    actions = {rank: [_parse(a) if a else None for a in row] for rank, row in order.items()}
    try:
        return dict(_schedules._validate_schedule(actions, pp, n_stages, n_microbatches))
    except AssertionError as exc:
        raise ValueError(str(exc)) from exc


def compute_only_order(schedule: Any) -> dict[int, list[str | None]]:
    """A built torch schedule's order per rank as action strings, compute actions only.

    Works for every torch schedule class that has a ``pipeline_order`` (all of the named
    ones: single-stage GPipe/1F1B list a REDUCE_GRAD step, which is dropped here, as torch's
    runtime adds it back when it lowers a compute-only schedule).
    """
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        raise TypeError(
            f"{type(schedule).__name__} has no pipeline_order to dump; "
            "expected a torch.distributed.pipelining schedule built for training"
        )
    return {
        rank: [
            None if a is None else str(a)
            for a in order[rank]
            if a is None or a.computation_type.value in COMPUTE_TYPES
        ]
        for rank in sorted(order)
    }


def rank_to_stage_ids(pp: int, n_stages: int, style: str) -> dict[int, list[int]]:
    """torch's placement of ``n_stages`` stages on ``pp`` ranks ("loop" or "v"), per rank."""
    return generate_rank_to_stage_mapping(pp, n_stages, style=style)


def new_csv_runtime(
    stages: list[Any],
    csv_path: str,
    *,
    n_microbatches: int,
    loss_fn: Callable[..., Any] | None,
    scale_grads: bool,
    **schedule_kwargs: Any,
) -> Any:
    """torch's action-list runtime over ``stages``, loaded with the compute-only CSV file.

    torch validates the CSV again, infers which rank holds which stage from it (overriding
    the looped default) and adds the send/recv, unshard/reshard and grad-reduce steps.
    """
    runtime = RUNTIME_SCHEDULE_CLASS(
        stages=stages,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
        **schedule_kwargs,
    )
    runtime._load_csv(csv_path, format="compute_only")
    return runtime


def runtime_from_order(
    stages: list[Any],
    order: dict[int, list[str | None]],
    *,
    n_microbatches: int,
    loss_fn: Callable[..., Any] | None,
    scale_grads: bool,
    **schedule_kwargs: Any,
) -> Any:
    """torch's action-list runtime over ``stages``, running the compute-only ``order``
    (action strings per rank, e.g. a single-stage schedule's ``compute_only_order``).

    As with a CSV file, torch validates the order and adds send/recv, unshard/reshard and
    grad-reduce steps.
    """
    runtime = RUNTIME_SCHEDULE_CLASS(
        stages=stages,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
        **schedule_kwargs,
    )
    runtime.pipeline_order = {
        rank: [None if a is None else _parse(a) for a in row] for rank, row in order.items()
    }
    runtime._validate_and_set_stage_mapping(runtime.pipeline_order)
    runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    return runtime


@contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """Run only the forward actions of an action-list (runtime) schedule while inside.

    torch 2.13's ``eval()`` on runtime schedules still executes the backward actions of their
    order (zero-bubble and V schedules then fail: "can't steal_bwd_input ..."). Here the
    compute order's forwards (the F half of an overlapped F/B step included) are kept in
    their order and lowered again with torch's own send/recv pass; a subsequence of a valid
    order cannot deadlock, since forwards wait only on forwards. Other schedules are left
    as they are.
    """
    if not isinstance(schedule, RUNTIME_SCHEDULE_CLASS) or not schedule.pipeline_order:
        yield
        return
    F = _schedules._ComputationType.FORWARD
    forwards: dict[int, list[Any]] = {}
    for rank, row in schedule.pipeline_order.items():
        kept = []
        for action in row:
            if action is None:
                continue
            for sub in action.sub_actions or (action,):
                if sub.computation_type == F:
                    kept.append(sub)
        forwards[rank] = kept
    saved = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = _schedules._add_send_recv(
        forwards,
        stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s],
        num_stages=schedule._num_stages,
    )
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = saved


# --- schedules as values without processes (for the schedule simulator) -----------------------


class _StageStandIn:
    """What torch's schedule constructors read of a pipeline stage, and nothing else.

    torch 2.13's multi-stage schedule classes read ``num_stages``, ``group_size``,
    ``group_rank`` and ``stage_index`` of their stages, look at ``submod`` for compiled modules
    (zero-bubble and V schedules) and set ``stage_index_to_group_rank``. Every rank computes
    every rank's order, so the stand-ins of one rank give the whole schedule.
    """

    __slots__ = ("stage_index", "num_stages", "group_size", "group_rank", "submod",
                 "stage_index_to_group_rank")

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def _stand_ins(pp: int, n_stages: int, stage_ids: Sequence[int]) -> list[Any]:
    return [_StageStandIn(s, n_stages, pp, 0) for s in sorted(stage_ids)]


def _as_strings(order: dict[int, list[Any]]) -> dict[int, list[str | None]]:
    return {rank: [None if a is None else str(a) for a in order[rank]] for rank in sorted(order)}


def lowered_named_schedule(
    torch_class: type, *, pp: int, n_stages: int, n_microbatches: int, style: str
) -> tuple[dict[int, list[str | None]], dict[int, list[str]], dict[int, int]]:
    """A multi-stage torch schedule's orders for every rank, built without processes.

    Constructs ``torch_class`` over stand-ins of rank 0's stages (placed with ``style``,
    "loop" or "v"), exactly as a training rank does, and returns three plain values:
    the compute-only order per rank (None = idle step), the order torch's runtime actually
    runs per rank (with UNSHARD/RESHARD, REDUCE_GRAD, SEND_*/RECV_* added by torch's own
    lowering), and stage index -> pp rank.
    """
    stage_ids = rank_to_stage_ids(pp, n_stages, style)[0]
    schedule = torch_class(
        _stand_ins(pp, n_stages, stage_ids),
        n_microbatches=n_microbatches,
        loss_fn=lambda output, target: output,  # training: a loss (never called here)
        scale_grads=False,
    )
    return (
        _as_strings(schedule.pipeline_order),
        _as_strings(schedule.pipeline_order_with_comms),  # type: ignore[arg-type]
        dict(schedule.stage_index_to_group_rank),
    )


_NO_COMMS: dict[type, type] = {}
"""torch schedule class -> its subclass that skips the lowering to comms."""


def named_compute_order(
    torch_class: type, *, pp: int, n_stages: int, n_microbatches: int, style: str
) -> tuple[dict[int, list[str | None]], dict[int, int]]:
    """A multi-stage torch schedule's compute-only order per rank and stage index -> pp rank,
    without torch's lowering (which adds the comms and costs O(actions²) in
    ``_add_unshard_reshard``: seconds at pp=64): the class is constructed with its
    ``_prepare_schedule_with_comms`` skipped."""
    no_comms = _NO_COMMS.get(torch_class)
    if no_comms is None:
        no_comms = _NO_COMMS[torch_class] = type(
            f"{torch_class.__name__}ComputeOnly", (torch_class,),
            {"_prepare_schedule_with_comms": lambda self, *args, **kwargs: None})
    stage_ids = rank_to_stage_ids(pp, n_stages, style)[0]
    schedule = no_comms(
        _stand_ins(pp, n_stages, stage_ids),
        n_microbatches=n_microbatches,
        loss_fn=lambda output, target: output,
        scale_grads=False,
    )
    return _as_strings(schedule.pipeline_order), dict(schedule.stage_index_to_group_rank)


def lowered_compute_order(
    order: dict[int, Sequence[str | None]], *, pp: int, n_stages: int, n_microbatches: int
) -> tuple[dict[int, list[str]], dict[int, int]]:
    """Lower a compute-only order (action strings per rank) as torch's runtime does.

    torch validates the order (ValueError here if it is not a valid schedule), infers which
    rank holds which stage from it, and adds UNSHARD/RESHARD, REDUCE_GRAD and SEND_*/RECV_*
    steps. Returns the lowered order per rank and stage index -> pp rank.
    """
    stage_to_rank = validate_compute_order(
        order, pp=pp, n_stages=n_stages, n_microbatches=n_microbatches
    )
    first = min(s for s, r in stage_to_rank.items() if r == 0)
    runtime = runtime_from_order(
        _stand_ins(pp, n_stages, [first]),
        {rank: list(row) for rank, row in order.items()},
        n_microbatches=n_microbatches,
        loss_fn=lambda output, target: output,
        scale_grads=False,
    )
    lowered = _as_strings(runtime.pipeline_order_with_comms)  # type: ignore[arg-type]
    return lowered, stage_to_rank  # type: ignore[return-value]


@functools.lru_cache(maxsize=1 << 16)
def action_parts(text: str) -> tuple[ComputePart, ...]:
    """Any action string of torch's runtime as (stage, type, microbatch) steps, in run order.

    "2F0" -> [(2, "F", 0)]; "1UNSHARD" -> [(1, "UNSHARD", None)]; "(0F3;3B1)OVERLAP_F_B" ->
    [(0, "F", 3), (3, "B", 1)] (torch's runtime runs the two halves one after the other).
    Raises ValueError for a malformed or empty string.
    """
    action = _parse(text)
    if action is None:
        raise ValueError("an empty action string is an idle step, not an action")
    if action.sub_actions is not None:
        return tuple(
            (sub.stage_index, sub.computation_type.value, sub.microbatch_index)
            for sub in action.sub_actions
        )
    return ((action.stage_index, action.computation_type.value, action.microbatch_index),)


def pipeline_stage_with_inference_context(module: Any, stage_id: int, n_stages: int,
                                          device: Any, *, context: Callable[[], Any],
                                          **kwargs: Any) -> Any:
    """torch's ``PipelineStage`` whose shape inference (the one extra forward on
    placeholder tensors its first step runs, ``_forward_metadata_inference``) runs inside
    ``context()``: e.g. a context that restores the statistics a module's forward keeps
    (MoE token counts), which that forward must not count."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kw: Any) -> Any:
            with context():
                return super()._forward_metadata_inference(*args, **kw)

    return _Stage(module, stage_id, n_stages, device, **kwargs)
