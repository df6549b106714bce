"""Pipeline schedules: names to torch classes, stage placement, checks, CSV schedules.

A schedule decides, for every pipeline rank, in which order it runs the forward and backward
of each microbatch on each of its stages. autopp runs torch.distributed.pipelining's own
schedules; this package says what each one needs and builds it:

* :func:`schedule_info` / :data:`SCHEDULE_NAMES`: the schedules and their rules
  (:class:`ScheduleInfo`); a path to a CSV file is a schedule too.
* :func:`default_n_stages`, :func:`stage_ids_for_rank`: how many stages, and which on a rank.
* :func:`check_schedule_config`: a clear ValueError for sizes a schedule cannot run.
* :func:`build_schedule`: the torch schedule object for this rank's stages (``runtime=True``:
  the same steps on torch's action-list runtime, for graph stages).
* :func:`dump_schedule_csv`, :func:`read_schedule_csv`, :func:`schedule_order`: schedules as
  values, written to and read from CSV.
"""

from autopp.schedules._torch_compat import forward_only
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

__all__ = [
    "SCHEDULE_NAMES",
    "CsvSchedule",
    "Placement",
    "ScheduleInfo",
    "ScheduleOrder",
    "build_schedule",
    "check_batch_size",
    "check_schedule_config",
    "check_stage_count",
    "default_n_stages",
    "dump_schedule_csv",
    "forward_only",
    "is_csv_schedule",
    "microbatches_ok",
    "read_schedule_csv",
    "schedule_info",
    "schedule_order",
    "stage_ids_for_rank",
    "write_order_csv",
]
