"""One options value everywhere: ``pipeline_autoparallel``, ``plan_pipeline``, ``dry_run`` and
``search`` take the planner's options as ``options=PlannerOptions(...)`` and the batch as
``global_batch``; the old spellings are refused with the exact new one in the message, before
any planning."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import autopp
from autopp import PlannerOptions
from autopp.dry_run import dry_run
from tests.harness.models import ce_loss, llama3_meta


def _entry_points():
    return {"pipeline_autoparallel": autopp.pipeline_autoparallel,
            "plan_pipeline": autopp.plan_pipeline, "dry_run": dry_run,
            "search": autopp.search}


def test_the_four_entry_points_take_one_options_value_and_the_same_names():
    """Every entry point has ``options``; none has a planner option as its own keyword; the
    batch and sequence are ``global_batch`` / ``seq_len`` wherever they are taken."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(PlannerOptions)}
    for name, fn in _entry_points().items():
        params = inspect.signature(fn).parameters
        assert "options" in params, name
        # search's recompute is its own choice (a set of policies), not the planner option
        loose = sorted(p for p in params if p in fields and not (name == "search" and
                                                                  p == "recompute"))
        assert loose == [], (name, loose)
        assert "global_batch_size" not in params, name
    for name in ("plan_pipeline", "dry_run", "search"):
        assert {"global_batch", "seq_len"} <= set(inspect.signature(
            _entry_points()[name]).parameters), name
    assert "world_size" in inspect.signature(autopp.search).parameters


@pytest.mark.parametrize("name", ["pipeline_autoparallel", "plan_pipeline", "dry_run", "search"])
def test_loose_planner_options_are_refused_with_the_options_to_write(name):
    args = dict(
        pipeline_autoparallel=dict(mesh=None, example_inputs=(torch.zeros(4, 8, dtype=torch.long),),
                                   loss_fn=ce_loss, n_microbatches=2),
        plan_pipeline=dict(pp=2, n_microbatches=2, global_batch=4, seq_len=8),
        dry_run=dict(pp=2, dp=1, tp=1, n_microbatches=2, global_batch=4, seq_len=8),
        search=dict(world_size=2, global_batch=4, seq_len=8))[name]
    with pytest.raises(TypeError, match=re.escape(
            f"{name}(): the planner's options are one value: write "
            f"options=PlannerOptions(loss_parallel=False, profile='CPU') instead of "
            f"['loss_parallel', 'profile']")):
        _entry_points()[name](llama3_meta(2), **args, profile="CPU", loss_parallel=False)
    with pytest.raises(TypeError, match=re.escape(f"{name}() got unexpected keyword arguments "
                                                  f"['not_a_keyword']")):
        _entry_points()[name](llama3_meta(2), **args, not_a_keyword=1)


def test_global_batch_size_is_refused_with_global_batch():
    with pytest.raises(TypeError, match=re.escape(
            "plan_pipeline(): write global_batch=8 instead of global_batch_size=8; the "
            "planner's options are one value: write options=PlannerOptions(profile='CPU')")):
        autopp.plan_pipeline(llama3_meta(2), pp=2, n_microbatches=2, seq_len=8,
                             global_batch_size=8, profile="CPU")


def test_search_refuses_the_options_it_does_not_price():
    """The search prices layouts under profile, mixed precision, memory and tf32; another
    option is refused (not ignored), and recomputation is the search's own choice."""
    with pytest.raises(ValueError, match=re.escape(
            "search() does not price the planner's options ['boundary', 'weight_gathering']")):
        autopp.search(llama3_meta(2), world_size=2, global_batch=4, seq_len=8,
                      options=PlannerOptions(boundary="batch", weight_gathering="per_block"))
    with pytest.raises(ValueError, match=re.escape(
            "write recompute=('full',) (the search's choices) instead of "
            "options=PlannerOptions(recompute='full')")):
        autopp.search(llama3_meta(2), world_size=2, global_batch=4, seq_len=8,
                      options=PlannerOptions(recompute="full"))


def test_pipeline_autoparallel_options_go_with_the_planner_only():
    """``options=`` builds the planner of ``parallelize="auto"``; with a backend object or
    another shorthand it is refused, naming the fields given."""
    from autopp.api import resolve_backend
    from autopp.backends import Planner, Replicate

    opts = PlannerOptions(profile="CPU", boundary="batch")
    backend = resolve_backend("auto", options=opts)
    assert isinstance(backend, Planner) and backend.options is opts
    with pytest.raises(ValueError, match=re.escape("['boundary', 'profile'] are shorthands for "
                                                   "parallelize='auto'")):
        resolve_backend(Replicate(), options=opts)
    with pytest.raises(ValueError, match=re.escape(
            "options= (the planner's: ['boundary', 'profile']) needs parallelize='auto'")):
        resolve_backend(None, options=opts)
    assert isinstance(resolve_backend(None, options=PlannerOptions()), Replicate)
