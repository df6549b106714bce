"""``autopp.plan.parallel``: a pipeline's stages planned on forked processes give what the
sequential loop gives (the plans in stage order, the first error in stage order), and a
child that fails, dies or hangs costs only time."""

from __future__ import annotations

import os
import time

import pytest

from autopp.plan import parallel
from autopp.plan.parallel import map_stages, plan_workers

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _plan_of(parent: int, die: bool = False, hang: bool = False, fail: int | None = None):
    """A stage's "plan": (stage, the process that planned it). ``die`` / ``hang``: a child
    dies / hangs on the first stage it takes."""
    def plan_of(s: int):
        if s == fail:
            raise ValueError(f"stage {s} does not fit")
        if os.getpid() != parent:  # in a child
            if die:
                os._exit(3)
            if hang:
                time.sleep(3600)
        # long enough that every process takes some stages; the parent's first stage
        # longer, so that a child forked late under load still takes one
        time.sleep(1.0 if s == 0 and os.getpid() == parent else 0.2)
        return (s, os.getpid())
    return plan_of


def test_stages_planned_on_two_processes_come_back_in_order():
    parent = os.getpid()
    seen = []
    plans = map_stages(_plan_of(parent), 6, workers=2,
                        progress=lambda done, n, t: seen.append(done))
    assert [p[0] for p in plans] == list(range(6))
    assert len({p[1] for p in plans}) == 2  # both processes planned some
    assert sorted(seen) == list(range(1, 7))
    assert map_stages(_plan_of(parent), 3, workers=1) == tuple((s, parent) for s in range(3))


def test_an_error_is_raised_as_the_sequential_loop_raises_it():
    with pytest.raises(ValueError, match="stage 1 does not fit"):
        map_stages(_plan_of(os.getpid(), fail=1), 4, workers=2)


def test_a_child_that_dies_or_hangs_leaves_its_stages_to_the_parent(monkeypatch, caplog):
    parent = os.getpid()
    plans = map_stages(_plan_of(parent, die=True), 6, workers=2)
    assert plans == tuple((s, parent) for s in range(6))
    monkeypatch.setattr(parallel, "HUNG_S", 2.0)
    monkeypatch.setattr(parallel, "_POLL_S", 0.5)
    t0 = time.perf_counter()
    # the child hangs on the first stage it takes: the parent plans that one too
    plans = map_stages(_plan_of(parent, hang=True), 6, workers=2)
    assert plans == tuple((s, parent) for s in range(6))
    assert time.perf_counter() - t0 < 60
    assert "used no CPU" in caplog.text


def test_the_number_of_processes(monkeypatch):
    monkeypatch.setenv("AUTOPP_PLAN_WORKERS", "3")
    assert plan_workers(16) == 3 and plan_workers(2) == 2
    monkeypatch.setenv("AUTOPP_PLAN_WORKERS", "1")
    assert plan_workers(16) == 1
    monkeypatch.setenv("AUTOPP_PLAN_WORKERS", "two")
    with pytest.raises(ValueError, match="AUTOPP_PLAN_WORKERS='two'"):
        plan_workers(4)
    monkeypatch.delenv("AUTOPP_PLAN_WORKERS")
    monkeypatch.setattr(parallel, "_fork_safe", lambda: False)
    assert plan_workers(16) == 1


def test_tree_specs_sent_back_by_a_child_arrive_without_warnings():
    """Plans hold torch tree specs; a child's come back pickled, and torch 2.13 warns once
    per leaf spec it unpickles or copies (its deprecated ``LeafSpec``): none reaches the
    user (``import autopp`` pickles them plainly)."""
    import copy
    import warnings

    from torch.utils import _pytree

    parent = os.getpid()

    def plan_of(s: int):
        time.sleep(0.3)
        spec = _pytree.tree_structure(({"a": s, "b": [s, s]}, (s,)))
        return s, os.getpid(), spec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = map_stages(plan_of, 4, workers=2)
        copies = [copy.deepcopy(spec) for _, _, spec in plans]  # a copy rebuilds them too
    assert {pid for _, pid, _ in plans} - {parent}, "no stage came from the child"
    for s, _, spec in plans:
        assert spec == _pytree.tree_structure(({"a": s, "b": [s, s]}, (s,)))
    assert copies == [spec for _, _, spec in plans]
    assert not [w for w in caught if "LeafSpec" in str(w.message)], caught
