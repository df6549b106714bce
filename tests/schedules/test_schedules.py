"""Tests of autopp.schedules: names, placement, checks, CSV schedules, building torch schedules.

Stages are built in one process on torch's fake process group (any pp size, no communication);
one test forks 2 gloo processes to run built schedules against a single-process reference.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopp.schedules import (
    SCHEDULE_NAMES,
    build_schedule,
    check_schedule_config,
    default_n_stages,
    dump_schedule_csv,
    read_schedule_csv,
    schedule_info,
    schedule_order,
    stage_ids_for_rank,
)
from autopp._compat import pipelining as _torch_compat
from tests.harness.models import sum_loss
from tests.harness.parity import assert_all_parity

GOLDEN = Path(__file__).parents[1] / "golden"
DIM = 4


@contextlib.contextmanager
def fake_pp(pp: int, rank: int = 0):
    """A fake process group of ``pp`` ranks in which this process is ``rank``."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_stages(ids: list[int], n_stages: int) -> list[PipelineStage]:
    return [PipelineStage(nn.Linear(DIM, DIM), i, n_stages, torch.device("cpu")) for i in ids]


def build_for(name, pp: int, n_microbatches: int, rank: int = 0, n_stages: int | None = None):
    """Build ``name`` for ``rank`` of a fake pp group; run inside ``fake_pp``."""
    info = schedule_info(name)
    n_stages = n_stages or default_n_stages(name, pp)
    stages = make_stages(info.stage_ids_for_rank(rank, pp, n_stages), n_stages)
    return build_schedule(
        name, stages, n_microbatches=n_microbatches, loss_fn=sum_loss, scale_grads=False
    )


@pytest.fixture(autouse=True)
def _quiet_torch_logs():
    """torch logs a line per schedule built ("Using ScheduleGPipe"); keep test output short."""
    logger = logging.getLogger("torch.distributed.pipelining")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# --- names and metadata -----------------------------------------------------------------


def test_names_map_to_torch_classes():
    assert SCHEDULE_NAMES == (
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
        "ZBVZeroBubble", "DualPipeV",
    )  # fmt: skip
    for name in SCHEDULE_NAMES:
        info = schedule_info(name)
        assert info.torch_class is get_schedule_class(name)
        assert info.multi_stage == issubclass(info.torch_class, PipelineScheduleMulti)
        assert schedule_info(name.lower()) is info and schedule_info(name.upper()) is info


def test_unknown_name_lists_valid_names():
    expected = r"unknown pipeline schedule 'Zigzag'.*GPipe, 1F1B.*DualPipeV"
    with pytest.raises(ValueError, match=expected):
        schedule_info("Zigzag")


@pytest.mark.parametrize(
    "name, multi, style, lo, hi, default, splits",
    [
        ("GPipe", False, "loop", 1, 1, 1, False),
        ("1F1B", False, "loop", 1, 1, 1, False),
        ("Interleaved1F1B", True, "loop", 1, None, 2, False),
        ("LoopedBFS", True, "loop", 1, None, 2, False),
        ("InterleavedZeroBubble", True, "loop", 1, None, 2, True),
        ("ZBVZeroBubble", True, "v", 2, 2, 2, True),
        ("DualPipeV", True, "v", 2, 2, 2, True),
    ],
)
def test_metadata(name, multi, style, lo, hi, default, splits):
    info = schedule_info(name)
    assert (info.multi_stage, info.style) == (multi, style)
    assert (info.min_stages_per_rank, info.max_stages_per_rank) == (lo, hi)
    assert info.default_stages_per_rank == default and default_n_stages(name, 4) == 4 * default
    assert info.splits_backward == splits


# --- placement --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pp, n_stages, style, expected",
    [
        (1, 3, "loop", [[0, 1, 2]]),
        (2, 2, "loop", [[0], [1]]),
        (2, 4, "loop", [[0, 2], [1, 3]]),
        (3, 6, "loop", [[0, 3], [1, 4], [2, 5]]),
        (4, 8, "loop", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (1, 2, "v", [[0, 1]]),
        (2, 4, "v", [[0, 3], [1, 2]]),
        (3, 6, "v", [[0, 5], [1, 4], [2, 3]]),
        (4, 8, "v", [[0, 7], [1, 6], [2, 5], [3, 4]]),
        (2, 6, "v", [[0, 3, 4], [1, 2, 5]]),
    ],
)
def test_stage_ids_for_rank(pp, n_stages, style, expected):
    assert [stage_ids_for_rank(r, pp, n_stages, style) for r in range(pp)] == expected


def test_placement_errors():
    with pytest.raises(ValueError, match=r"n_stages=5 is not a multiple of pp=2.*n_stages=4 or 6"):
        stage_ids_for_rank(0, 2, 5, "loop")
    with pytest.raises(ValueError, match=r"pp_rank=2 is outside the pipeline's ranks 0\.\.1"):
        stage_ids_for_rank(2, 2, 4, "v")
    with pytest.raises(ValueError, match=r"unknown stage placement 'w'"):
        stage_ids_for_rank(0, 2, 4, "w")


# --- configuration checks ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, pp, n_stages, n_mb, batch, message",
    [
        # 1F1B needs n_microbatches >= 2 stages: 1 is not offered
        ("1F1B", 2, 2, 4, 6, r"batch size 6 is not divisible by n_microbatches=4: .*in \[2, 3, 6\]"),
        ("ZBVZeroBubble", 2, 3, 4, None,
         r"ZBVZeroBubble needs exactly 2 stages per rank, got 3 stages over pp=2; use n_stages=4"),
        ("ZBVZeroBubble", 2, 6, 4, None, r"needs exactly 2 stages per rank, got 6 stages over pp=2"),
        ("DualPipeV", 4, 4, 8, None, r"DualPipeV needs exactly 2 stages per rank, got 4 stages over pp=4"),
        ("GPipe", 2, 4, 4, None, r"GPipe needs exactly 1 stage per rank, got 4 stages over pp=2"),
        ("Interleaved1F1B", 2, 5, 4, None, r"n_stages=5 is not a multiple of pp=2"),
        ("1F1B", 4, 4, 3, None, r"1F1B needs n_microbatches >= n_stages=4.*got n_microbatches=3"),
        ("DualPipeV", 2, 4, 3, None, r"DualPipeV needs n_microbatches >= n_stages=4.*got n_microbatches=3"),
        ("Interleaved1F1B", 4, 8, 9, None,
         r"n_microbatches=9 into n_microbatches // pp = 2 rounds.*use n_microbatches=8 or 10"),
        ("InterleavedZeroBubble", 2, 4, 7, None,
         r"n_microbatches=7 into n_microbatches // pp = 3 rounds.*use n_microbatches=6 or 8"),
        ("LoopedBFS", 2, 4, 0, None, r"n_microbatches=0: a step needs at least one microbatch"),
    ],
)  # fmt: skip
def test_bad_configs_raise_with_numbers(name, pp, n_stages, n_mb, batch, message):
    with pytest.raises(ValueError, match=message):
        check_schedule_config(
            name, pp=pp, n_stages=n_stages, n_microbatches=n_mb, local_batch_size=batch
        )


def test_good_config_returns_info():
    info = check_schedule_config(
        "dualpipev", pp=2, n_stages=4, n_microbatches=4, local_batch_size=8
    )
    assert info.name == "DualPipeV"


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_checks_agree_with_torch(pp):
    """Our checks pass exactly the sizes torch 2.13's constructors accept, and raise first."""
    with fake_pp(pp):
        for name in SCHEDULE_NAMES:
            info = schedule_info(name)
            for per_rank in (1, 2, 3):
                n_stages = pp * per_rank
                stages = make_stages(stage_ids_for_rank(0, pp, n_stages, info.style), n_stages)
                for n_mb in range(1, 13):
                    try:
                        check_schedule_config(name, pp=pp, n_stages=n_stages, n_microbatches=n_mb)
                        ours = True
                    except ValueError:
                        ours = False
                    if not info.multi_stage and per_rank > 1:
                        theirs = False  # a single-stage class cannot take several stages
                    else:
                        try:
                            info.torch_class(stages if info.multi_stage else stages[0], n_mb)
                            theirs = True
                        except ValueError:
                            theirs = False
                    assert ours == theirs, (name, pp, per_rank, n_mb)


# --- CSV schedules ----------------------------------------------------------------------


def test_csv_round_trip_and_golden(tmp_path):
    path = tmp_path / "interleaved.csv"
    with fake_pp(2):
        original = build_for("Interleaved1F1B", pp=2, n_microbatches=4)
        dump_schedule_csv(original, path)
        loaded = build_for(path, pp=2, n_microbatches=4)
        assert isinstance(loaded, _torch_compat.RUNTIME_SCHEDULE_CLASS)
        assert schedule_order(loaded) == schedule_order(original)
    # the golden file is written only by scripts/update_golden.py, never by a test
    assert path.read_text() == (GOLDEN / "interleaved1f1b_pp2_spr2_mb4.csv").read_text()


def test_read_schedule_csv_infers_layout(tmp_path):
    spec = read_schedule_csv(GOLDEN / "interleaved1f1b_pp2_spr2_mb4.csv")
    assert (spec.pp, spec.n_stages, spec.n_microbatches) == (2, 4, 4)
    assert spec.stage_ids == ((0, 2), (1, 3)) and spec.style == "loop"
    assert not spec.splits_backward
    path = tmp_path / "zbv.csv"
    with fake_pp(2):
        dump_schedule_csv(build_for("ZBVZeroBubble", pp=2, n_microbatches=3), path)
    info = schedule_info(str(path))
    assert (info.style, info.splits_backward, info.microbatch_rule) == ("v", True, "fixed")
    assert info.stage_ids_for_rank(1, 2, 4) == [1, 2] and default_n_stages(path, 2) == 4
    with pytest.raises(ValueError, match=r"written for n_microbatches=3, got n_microbatches=4"):
        check_schedule_config(path, pp=2, n_stages=4, n_microbatches=4)
    expected = r"written for pp=2 and n_stages=4, got pp=4 and n_stages=8"
    with pytest.raises(ValueError, match=expected):
        check_schedule_config(path, pp=4, n_stages=8, n_microbatches=3)


def test_dualpipev_overlapped_actions_round_trip(tmp_path):
    path = tmp_path / "dualpipev.csv"
    with fake_pp(2):
        original = build_for("DualPipeV", pp=2, n_microbatches=4)
        dump_schedule_csv(original, path)
        assert "OVERLAP_F_B" in path.read_text()
        assert schedule_order(build_for(path, pp=2, n_microbatches=4)) == schedule_order(original)


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0,0B0\n0F0,0B0\n", r"Stage 0 is assigned to both rank 1 and rank 0"),
        ("0B0,0F0\n", r"Full Backward for stage 0, microbatch 0 without first running Forward"),
        ("0F0,0SEND_F0,0B0\n", r"rank 0, step 1: action '0SEND_F0' is not a compute action"),
        ("0F0,0X0\n", r"rank 0, step 1: Invalid action string"),
        ("0F0,1F0,1B0,0B0\n2F0,2B0\n", r"ranks hold different numbers of stages"),
        ("", r"is empty"),
    ],
)
def test_bad_csv_raises(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        schedule_info(path)


def test_missing_csv_raises():
    with pytest.raises(ValueError, match=r"schedule CSV file '/no/such\.csv' does not exist"):
        schedule_info("/no/such.csv")


# --- building ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("rank", [0, 1])
def test_build_each_schedule(name, rank):
    with fake_pp(2, rank=rank):
        sched = build_for(name, pp=2, n_microbatches=4, rank=rank)
        assert type(sched) is schedule_info(name).torch_class
        assert sched.scale_grads is False
        order = schedule_order(sched)
        assert sorted(order) == [0, 1] and all(order.values())


def test_build_rejects_wrong_stages():
    with fake_pp(2):
        stages = make_stages([0, 2], 4)  # the loop placement; ZBV wants [0, 3]
        kwargs = dict(n_microbatches=4, loss_fn=sum_loss, scale_grads=False)
        expected = (
            r"ZBVZeroBubble places stages \[0, 3\] on pp rank 0 of pp=2 "
            r"\(v placement of 4 stages\), but this rank was given stages \[0, 2\]"
        )
        with pytest.raises(ValueError, match=expected):
            build_schedule("ZBVZeroBubble", stages, **kwargs)
        expected = r"1F1B needs exactly 1 stage per rank, got 4 stages over pp=2"
        with pytest.raises(ValueError, match=expected):
            build_schedule("1F1B", stages, **kwargs)


# --- running: 2 gloo processes against a single-process reference -------------------------


@pytest.mark.multiprocess
def test_built_schedules_match_single_process_gradients(tmp_path):
    from tests.harness.launch import run_on_ranks
    from tests.harness.workers.pipeline import built_schedules

    csv_path = tmp_path / "zbv_mb2.csv"
    with fake_pp(2):
        dump_schedule_csv(build_for("ZBVZeroBubble", pp=2, n_microbatches=2), csv_path)
    names = [(str(csv_path), 2), ("ZBVZeroBubble", 2), ("1F1B", 4)]
    for rank, grads in enumerate(run_on_ranks(built_schedules, 2, names, timeout=300)):
        assert [name for name, _ in grads] == [n for n, _ in names], grads
        for name, per_stage in grads:
            for stage, (got, want) in per_stage.items():
                assert_all_parity(got, want, what=f"{name} rank {rank} stage {stage}")


def test_every_microbatch_suggestion_passes_the_checks_it_replaces():
    """A batch that does not split into the microbatches: each n_microbatches (and each
    schedule) the message suggests passes ``check_schedule_config`` at the same sizes, and
    when no count dividing the batch suits the schedule, the message says so instead of
    suggesting one that fails (batch 1 at pp=4 with 1F1B used to suggest n_microbatches=1)."""
    import re

    from autopp.schedules.checks import check_schedule_config

    cases = [("1F1B", 4, 4, 4, 1), ("1F1B", 4, 4, 4, 6), ("1F1B", 2, 2, 4, 6),
             ("Interleaved1F1B", 4, 8, 8, 6), ("ZBVZeroBubble", 2, 4, 4, 3), ("GPipe", 4, 4, 4, 6)]
    for name, pp, n_stages, m, batch in cases:
        with pytest.raises(ValueError) as err:
            check_schedule_config(name, pp=pp, n_stages=n_stages, n_microbatches=m,
                                  local_batch_size=batch)
        msg = str(err.value)
        counts = re.search(r"n_microbatches in \[([\d, ]+)\]", msg)
        assert counts, msg
        others = re.search(r"but ([\w, ]+) runs? it with", msg)
        schedules = others.group(1).split(", ") if others else [name]
        for sched in schedules:
            for count in map(int, counts.group(1).split(", ")):
                check_schedule_config(sched, pp=pp, n_stages=n_stages, n_microbatches=count,
                                      local_batch_size=batch)
    with pytest.raises(ValueError, match=r"no count dividing 1 suits 1F1B with 4 stages over "
                                         r"pp=4, but GPipe, LoopedBFS run it with n_microbatches"
                                         r" in \[1\]"):
        check_schedule_config("1F1B", pp=4, n_stages=4, n_microbatches=4, local_batch_size=1)
