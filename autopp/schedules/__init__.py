"""Pipeline schedules: names to torch classes, stage placement, checks, CSV schedules.

autopp runs torch.distributed.pipelining's own schedules; this package says what each needs
and builds it: :func:`schedule_info` / :data:`SCHEDULE_NAMES` (the rules; a CSV path is a
schedule too), :func:`default_n_stages` and :func:`stage_ids_for_rank` (stages and their
ranks), :func:`check_schedule_config` (a clear ValueError for sizes a schedule cannot run),
:func:`build_schedule` (the torch schedule for this rank's stages, on torch's action-list
runtime for graph stages), CSV round trips (:func:`dump_schedule_csv`,
:func:`read_schedule_csv`, :func:`schedule_order`), :func:`schedule_actions` (every rank's
action list as torch's runtime runs it, without processes), and :func:`simulate_schedule` /
:func:`simulate` (one step from per-stage costs: step time, bubbles, memory per rank), drawn
by :func:`write_chrome_trace` and :func:`write_timeline_png`."""

from autopp._compat.pipelining import forward_only
from autopp.schedules.actions import ScheduleActions, actions_from_order, schedule_actions
from autopp.schedules.build import build_schedule
from autopp.schedules.checks import check_batch_size, check_schedule_config, microbatches_ok
from autopp.schedules.csv_schedules import (
    CsvSchedule,
    ScheduleOrder,
    dump_schedule_csv,
    is_csv_schedule,
    read_schedule_csv,
    schedule_order,
    write_order_csv,
)
from autopp.schedules.placement import Placement, check_stage_count, stage_ids_for_rank
from autopp.schedules.registry import (
    SCHEDULE_NAMES,
    ScheduleInfo,
    default_n_stages,
    schedule_info,
)
from autopp.schedules.simulate import (
    MEMORY_CATEGORIES,
    ActionEvent,
    Link,
    MemoryBreakdown,
    MemoryTimeline,
    RankSummary,
    SimulationResult,
    StageCost,
    simulate,
    simulate_schedule,
)
from autopp.schedules.timeline import chrome_trace, write_chrome_trace, write_timeline_png

__all__ = [
    "MEMORY_CATEGORIES",
    "SCHEDULE_NAMES",
    "ActionEvent",
    "CsvSchedule",
    "Link",
    "MemoryBreakdown",
    "MemoryTimeline",
    "Placement",
    "RankSummary",
    "ScheduleActions",
    "ScheduleInfo",
    "ScheduleOrder",
    "SimulationResult",
    "StageCost",
    "actions_from_order",
    "build_schedule",
    "check_batch_size",
    "check_schedule_config",
    "check_stage_count",
    "chrome_trace",
    "default_n_stages",
    "dump_schedule_csv",
    "forward_only",
    "is_csv_schedule",
    "microbatches_ok",
    "read_schedule_csv",
    "schedule_actions",
    "schedule_info",
    "schedule_order",
    "simulate",
    "simulate_schedule",
    "stage_ids_for_rank",
    "write_chrome_trace",
    "write_order_csv",
    "write_timeline_png",
]
