"""PipelinePlan: one value for a whole pipeline, made by a dry run, saved, and run again by
``pipeline_autoparallel(plan=path)`` without planning.

A dry run (fake process group, in a subprocess: it needs a fresh process) plans llama3's
debugmodel for pp2 x dp2 x tp1 and saves its plan; the plan round-trips through JSON; 4
gloo processes run it (loss and gradients equal the single-process model's, nothing planned
at run time) and, in the same launch, plan the same pipeline themselves (rank 0 plans, the
others receive its plan and plan nothing; the same placements as the dry run's); a plan
for another configuration is refused with what differs; the cache key follows the
boundary-planning code."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopp import PipelinePlan, build_world_mesh, init_fake_world, pipeline_autoparallel
from tests.harness.models import ce_loss, llama3_meta, make_batch
from tests.harness.reference import reference_run
from tests.harness.checks import BATCH, N_LAYERS, SEQ, check_step, llama3_case

ROOT = Path(__file__).resolve().parents[2]
DP, N_MB = 2, 4

CODE = r"""
import sys
from tests.harness.models import llama3_meta
from autopp.backends import PlannerOptions
from autopp.dry_run import dry_run

r = dry_run(llama3_meta(int(sys.argv[2])), pp=2, dp=2, tp=1, schedule="1F1B",
            n_microbatches=int(sys.argv[3]), global_batch=int(sys.argv[4]),
            seq_len=int(sys.argv[5]), options=PlannerOptions(profile="CPU"),
            activations=False)
r.plan.save(sys.argv[1])
"""


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pipeline_plan")
    path = tmp / "plan.json"
    env = dict(os.environ, AUTOPP_PLAN_CACHE=str(tmp / "plans"))
    proc = subprocess.run(
        [sys.executable, "-c", CODE, str(path), str(N_LAYERS), str(N_MB), str(BATCH), str(SEQ)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return path


def test_json_round_trip(saved_plan):
    from autopp.plan.value import model_fingerprint

    plan = PipelinePlan.load(saved_plan)
    assert PipelinePlan.from_json(plan.to_json()) == plan
    assert plan != dataclasses.replace(plan, n_microbatches=8)
    assert (plan.pp, plan.dp, plan.tp, plan.schedule, plan.n_microbatches) == (2, 2, 1, "1F1B", 4)
    assert plan.model == model_fingerprint(llama3_meta(N_LAYERS)) != model_fingerprint(
        llama3_meta(N_LAYERS - 2))
    assert plan.input_shapes == ((BATCH // DP, SEQ),) and plan.input_dtypes == ("torch.int64",)
    assert plan.fqns_per_stage[0][0] == "tok_embeddings" and plan.stage_ranks == (0, 1)
    assert plan.boundaries == ("batch",) * 3 and plan.loss_placement == "batch"
    assert plan.recompute == ("none", "none") and plan.options.profile == "CPU"
    assert len(plan.stage_plans) == 2 and plan.stage_plans[1].loss is not None
    e = plan.estimates  # the dry run's simulation travels with the plan
    assert e is not None and e.step_time_s > 0 and len(e.peak_bytes) == 2
    assert [sum(b for _, b in cats) for cats in e.memory_at_peak] == list(e.peak_bytes)
    text = plan.describe()
    assert "stage 0 (pp rank 0): tok_embeddings, layers.0-2" in text
    assert "estimated step" in text and "pp=2 x dp=2 x tp=1" in text


def test_old_plan_format_is_refused_with_the_fix(saved_plan):
    d = json.loads(saved_plan.read_text())
    d["format"] = 1
    with pytest.raises(ValueError, match=r"format 1 is not 2 \(format 1 did not record each "
                                         r"stage's inputs.*plan again"):
        PipelinePlan.from_json(json.dumps(d))


def test_plan_carries_stage_inputs_and_send_bytes(saved_plan):
    plan = PipelinePlan.load(saved_plan)
    mb = BATCH // N_MB  # one dp-global microbatch
    assert plan.stage_inputs[0] == (("args[0]", (mb, SEQ), "torch.int64"),)
    (name, shape, dtype), = plan.stage_inputs[1]
    assert name == "args[0]" and shape[:2] == (mb, SEQ) and dtype == "torch.float32"
    # stage 0 sends its (mb, seq, dim) fp32 activation split over dp on the batch
    assert plan.send_bytes == (mb * SEQ * shape[2] * 4 // DP, 0)


@pytest.fixture
def fake_world():
    init_fake_world(4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(plan, pp=2, dp=2, n_microbatches=N_MB, n_layers=N_LAYERS, **kw):
    mesh = build_world_mesh(pp=pp, dp=dp, tp=4 // pp // dp)
    return pipeline_autoparallel(
        llama3_meta(n_layers), mesh, example_inputs=(torch.zeros(BATCH // dp, SEQ, dtype=torch.long),),
        loss_fn=ce_loss, schedule="1F1B", n_microbatches=n_microbatches, plan=plan, **kw)


def test_mismatched_plan_raises(saved_plan, fake_world):
    from autopp.backends import Planner, PlannerOptions

    with pytest.raises(ValueError, match=r"does not match this pipeline: pp: the plan has 2, "
                                         r"this pipeline 4; dp: the plan has 2, this pipeline "
                                         r"1; .*leave out plan="):
        _run(saved_plan, pp=4, dp=1)
    with pytest.raises(ValueError, match=r"n_microbatches: the plan has 4, this pipeline 2"):
        _run(saved_plan, n_microbatches=2)
    with pytest.raises(ValueError, match=r"model: parameters: the plan's model has \d+, this "
                                         r"one \d+; only the plan's has layers\.4-\d"):
        _run(saved_plan, n_layers=4)
    with pytest.raises(ValueError, match=r"boundary: the plan has 'auto', the options "
                                         r"'batch\+seq'"):
        _run(saved_plan, options=PlannerOptions(boundary="batch+seq"))
    with pytest.raises(ValueError, match="plan= runs a planned pipeline and needs the planner"):
        _run(saved_plan, parallelize=None)
    # a matching plan is taken as it is: no planning, its split
    pipe = _run(None, parallelize=Planner(PlannerOptions(), plan=str(saved_plan)))
    assert pipe.backend.plan_source == "given"
    assert pipe.backend.pipeline_plan == PipelinePlan.load(saved_plan)
    assert pipe.layout.fqns_per_stage == PipelinePlan.load(saved_plan).fqns_per_stage


def test_stage_modules_built_and_run_on_meta_once_per_rank(saved_plan, fake_world,
                                                          monkeypatch):
    """With a plan, a rank builds every stage on meta once and runs each once (the check of
    the stages' forwards); the runtime reads the stages' inputs from the plan."""
    import autopp.api
    import autopp.stage_split
    from autopp.backends import Planner, PlannerOptions

    builds, forwards = [], []
    real = autopp.stage_split.build_stage_module

    def counting(model, fqns, *a, **k):
        builds.append(tuple(fqns))
        return real(model, fqns, *a, **k)

    monkeypatch.setattr(autopp.api, "build_stage_module", counting)
    monkeypatch.setattr(autopp.stage_split, "build_stage_module", counting)
    model_type = type(llama3_meta(N_LAYERS))

    def hook(module, args):
        if type(module) is model_type and any(p.is_meta for p in module.parameters()):
            forwards.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        _run(None, parallelize=Planner(PlannerOptions(), plan=str(saved_plan)))
    finally:
        handle.remove()
    plan = PipelinePlan.load(saved_plan)
    assert sorted(builds) == sorted(plan.fqns_per_stage)  # each stage once
    assert len(forwards) == plan.n_stages and len({id(m) for m in forwards}) == plan.n_stages


def test_cache_key_follows_the_boundary_planning_code(tmp_path, monkeypatch):
    import autopp.plan.cache as plan_cache
    import autopp.sharding.cache_key as cache_key

    files = plan_cache.planner_source_files()
    assert {"plan/make.py", "plan/value.py", "graph/recompute.py",
            "schedules/comm_windows.py", "schedules/simulate.py"} <= {
        f"{f.parent.name}/{f.name}" for f in files}

    def keys():
        stage = torch.nn.Linear(2, 2, device="meta")
        return (plan_cache.pipeline_plan_key({"model": "m"}),
                plan_cache.plan_key(stage, (), (2, 1), ("dp", "tp"), {}))

    before = keys()
    assert keys() == before
    changed = tmp_path / "make.py"
    original = next(f for f in files if f.name == "make.py" and f.parent.name == "plan")
    changed.write_bytes(original.read_bytes() + b"\n# another boundary rule\n")
    monkeypatch.setattr(cache_key, "planner_source_files",
                        lambda: [changed if f == original else f for f in files])
    after = keys()
    assert after[0] != before[0] and after[1] != before[1]


@pytest.mark.multiprocess
def test_saved_plan_runs_without_planning(saved_plan):
    """pp2 x dp2 x tp1 on 4 gloo processes: the saved plan runs (nothing planned), and the
    same pipeline planned at run time (rank 0 plans, broadcast) has the dry run's placements."""
    from tests.harness.launch import run_on_ranks
    from tests.harness.workers.pipeline import run_configs

    reference = reference_run(llama3_meta(N_LAYERS), [make_batch(BATCH, SEQ)])
    configs = [llama3_case("1F1B", 2, dp=DP, n_microbatches=N_MB, parallelize="auto", plan=str(saved_plan),
                    count_planning=True),
               llama3_case("1F1B", 2, dp=DP, n_microbatches=N_MB, parallelize="auto", plan=None,
                    count_planning=True)]
    results = run_on_ranks(run_configs, 4, configs)
    check_step(results, configs, reference)
    saved = PipelinePlan.load(saved_plan)
    for rank, (given, fresh) in enumerate(results):
        assert given["plan_source"] == "given"
        assert given["planning_calls"] == {"plan_whole_pipeline": 0, "plan_local_stage": 0}
        assert PipelinePlan.from_json(given["pipeline_plan"]) == saved
        if rank == 0:
            assert fresh["plan_source"] in ("planned", "cached")
            assert fresh["planning_calls"]["plan_whole_pipeline"] == 1
        else:
            assert fresh["plan_source"] == "from rank 0"
            assert fresh["planning_calls"] == {"plan_whole_pipeline": 0, "plan_local_stage": 0}
        ran = PipelinePlan.from_json(fresh["pipeline_plan"])
        assert ran.estimates is None and ran.options == saved.options
        assert (ran.fqns_per_stage, ran.stage_ranks, ran.boundaries) == (
            saved.fqns_per_stage, saved.stage_ranks, saved.boundaries)
        assert [p.params for p in ran.stage_plans] == [p.params for p in saved.stage_plans]
    assert len({r[1]["pipeline_plan"] for r in results}) == 1  # one plan on every rank


def test_a_model_mismatch_names_what_differs():
    """The first difference between the plan's model and another, in words: the class, the
    parameters only one has (compacted), a parameter's shape (e.g. the vocabulary)."""
    from torch import nn

    from autopp.plan.value import model_structure, structure_difference

    def lm(vocab: int, layers: int) -> nn.Module:
        m = nn.Module()
        m.tok_embeddings = nn.Embedding(vocab, 8)
        m.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        return m

    planned = model_structure(lm(100, 4))
    assert structure_difference(planned, lm(100, 4)) is None
    assert structure_difference(planned, lm(100, 2)) == (
        "parameters: the plan's model has 9, this one 5; only the plan's has layers.2-3")
    assert structure_difference(planned, lm(128, 4)) == (
        "param tok_embeddings.weight: the plan has [100, 8] float32, this model [128, 8] float32")
    assert structure_difference(planned, nn.Linear(8, 8)).startswith(
        "model class: the plan's is torch.nn.modules.module.Module, this one "
        "torch.nn.modules.linear.Linear")


def test_a_fallback_is_warned_shown_and_refused_under_strict(tmp_path, monkeypatch, caplog):
    """An op whose DTensor rule fails is replicated (the plan still runs), logged as a
    warning, listed by ``describe()``; ``PlannerOptions(strict=True)`` refuses the plan,
    freshly planned or read from the cache. The rule failure is injected into llama3's
    silu (whose real rule works: the unpatched plan has no fallback, checked first)."""
    import logging

    import autopp.sharding.planner as sharding_planner
    import autopp.sharding.options.strategies as strategies
    from autopp import plan_pipeline
    from autopp.backends import PlannerOptions

    kw = dict(pp=2, dp=1, tp=2, n_microbatches=2, global_batch=2, seq_len=SEQ)
    monkeypatch.setenv("AUTOPP_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.setattr(sharding_planner, "_MEMO", sharding_planner._Memo())
    clean = plan_pipeline(llama3_meta(2), options=PlannerOptions(profile="CPU", strict=True),
                          **kw)
    assert clean.degraded() == []

    real = strategies._Enumerator._ask_dtensor

    def failing(self, node, args):
        if node.target == torch.ops.aten.silu.default:
            return [], None, "rule failed: RuntimeError: injected"
        return real(self, node, args)

    monkeypatch.setattr(strategies._Enumerator, "_ask_dtensor", failing)
    monkeypatch.setattr(strategies, "_WARNED", set())
    monkeypatch.setenv("AUTOPP_PLAN_CACHE", str(tmp_path / "plans2"))
    monkeypatch.setattr(sharding_planner, "_MEMO", sharding_planner._Memo())
    with caplog.at_level(logging.WARNING, logger="autopp.sharding.options.strategies"):
        plan = plan_pipeline(llama3_meta(2), options=PlannerOptions(profile="CPU"), **kw)
    warned = [r.getMessage() for r in caplog.records if "aten.silu" in r.getMessage()]
    assert len(warned) == 1 and "strict=True" in warned[0], warned  # once, for both stages
    bad = plan.degraded()
    assert bad and all("aten.silu.default (rule failed: RuntimeError: injected)" in b
                       for b in bad), bad
    assert {b.split(":")[0] for b in bad} == {"stage 0", "stage 1"}
    assert "replicated for want of a DTensor rule" in plan.describe()
    with pytest.raises(ValueError, match=r"strict planning: \d+ fallback\(s\) changed the "
                                         r"plan: stage 0: replicated for want of a DTensor "
                                         r"rule: .*silu"):
        plan_pipeline(llama3_meta(2), options=PlannerOptions(profile="CPU", strict=True), **kw)


def test_a_cached_plan_that_does_not_apply_is_evicted(fake_world, tmp_path, monkeypatch):
    """A plan cache entry whose block was planned for another graph (as after a change the
    key cannot see) fails at apply with the entry named, is evicted with the stage entries
    it was made from, and the next run plans anew and applies."""
    from autopp.backends import Planner, PlannerOptions
    from autopp.lower.apply import PlanMismatchError

    monkeypatch.setenv("AUTOPP_PLAN_CACHE", str(tmp_path))
    first = _run(None, parallelize=Planner(PlannerOptions()))
    plan = first.backend.pipeline_plan
    assert first.backend.plan_source == "planned" and plan.cache_entries
    entries = [tmp_path / f"{k}.json" for k in plan.cache_entries]
    assert all(p.exists() for p in entries)
    whole = entries[0]
    d = json.loads(whole.read_text())
    d["stage_plans"][0]["blocks"][-1]["signature"] = "planned-for-another-graph"
    whole.write_text(json.dumps(d))

    stale = _run(None, parallelize=Planner(PlannerOptions()))
    assert stale.backend.plan_source == "cached"
    with pytest.raises(PlanMismatchError, match=rf"traces to a different graph.*entry "
                                                rf"{plan.cache_entries[0]}.*evicted"):
        stale.init_weights()
    assert not any(p.exists() for p in entries)

    fresh = _run(None, parallelize=Planner(PlannerOptions()))
    assert fresh.backend.plan_source == "planned"
    fresh.init_weights()  # applies
