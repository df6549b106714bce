"""Alike stages planned once (:mod:`autopp.plan.stage_classes`): a dry run whose middle
stages hold alike blocks plans fewer distinct stage plans than stages, and its plan is the
plan made with every stage planned alone (``AUTOPP_PLAN_REUSE=0``), names and all.

The fake process group needs a fresh process: the dry runs run in a subprocess that prints
what the test compares as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autopp.plan.stage_classes import IN_FLIGHT_RATIO, StageClass, group, in_flight_class

ROOT = Path(__file__).resolve().parents[2]

CODE = r"""
import dataclasses, json, os
from tests.harness.models import llama3_meta
from autopp.dry_run import dry_run

def run():
    r = dry_run(llama3_meta(6), pp=4, dp=2, tp=1, schedule="GPipe", n_microbatches=2,
                global_batch=8, seq_len=64, activations=False)
    plans = [dataclasses.asdict(dataclasses.replace(
        p, plan_s=0.0, solve_s=0.0, notes=(), cache_entry=None)) for p in r.plan.stage_plans]
    return dict(distinct=r.distinct_plans, n=r.n_stages, plans=plans, text=str(r),
                reused=[s.reused_from for s in r.stages], step=r.step_time_s,
                fqns=[sorted(p.fqn for p in s.params) for s in r.plan.stage_plans],
                stage_fqns=[sorted(f"{m}." for m in f) for f in r.plan.fqns_per_stage])

out = {"reuse": run()}
os.environ["AUTOPP_PLAN_REUSE"] = "0"
out["alone"] = run()
print("JSON" + json.dumps(out, default=str))
"""


def test_alike_stages_share_one_plan_and_it_is_the_plan_made_alone(tmp_path):
    env = dict(os.environ, AUTOPP_PLAN_CACHE=str(tmp_path / "plans"), AUTOPP_PLAN_WORKERS="1")
    env.pop("AUTOPP_PLAN_REUSE", None)
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])
    reuse, alone = out["reuse"], out["alone"]
    # stages 1 and 2 hold two alike blocks each: one plan for both
    assert reuse["n"] == alone["n"] == 4
    assert reuse["reused"] == [None, None, 1, None], reuse["reused"]
    assert reuse["distinct"] == 3 and alone["distinct"] == 4
    assert "3 distinct stage plans made under budgets for 4 stages" in reuse["text"]
    assert "stage 1's plan reused" in reuse["text"]
    # the reused plan names the member's own parameters and blocks
    for fqns, prefixes in zip(reuse["fqns"], reuse["stage_fqns"]):
        assert all(any(f.startswith(p) for p in prefixes) for f in fqns), (fqns, prefixes)
    assert reuse["plans"] == alone["plans"]
    assert reuse["step"] == alone["step"]


class _Mem:
    def __init__(self, f, budget, split=()):
        self.activation_factor, self.budget_bytes, self.split_in_flight = f, budget, split


class _Req:
    def __init__(self, f, budget, windows=(0.0, 0.0), split=()):
        self.memory = _Mem(f, budget, split)
        self.comm_windows_s = windows


def test_budget_classes_plan_for_the_most_in_flight_and_the_least_budget():
    """Members of a class fit its plan: it is made for their most microbatches in flight,
    least budget and smallest windows; in-flight counts within the ratio share a class, a
    split backward's do not."""
    assert in_flight_class(_Req(32, 1)) == in_flight_class(_Req(29, 1))
    assert in_flight_class(_Req(32, 1)) != in_flight_class(_Req(32 / IN_FLIGHT_RATIO ** 1.5, 1))
    assert in_flight_class(_Req(4, 1, split=((4, 1),)))[0] == "exact"
    # AUTOPP_PLAN_REUSE=exact: only equal in flight and budgets share
    assert in_flight_class(_Req(32, 1), None) != in_flight_class(_Req(29, 1), None)
    assert in_flight_class(_Req(32, 1), None) == in_flight_class(_Req(32, 1), None)
    reqs = [_Req(32, 10.0, (0.1, 0.3)), _Req(29, 9.0, (0.2, 0.1)), _Req(3, 5.0)]
    classes = group([("a",), ("a",), None], reqs)
    assert classes == [StageClass(stages=(0, 1), activation_factor=32, budget_bytes=9.0,
                                  windows=(0.1, 0.1)),
                       StageClass(stages=(2,), activation_factor=3, budget_bytes=5.0,
                                  windows=(0.0, 0.0))]


def test_class_keys_of_a_split_backward_keep_its_in_flight_exact():
    """A split backward's stages (ZBV, DualPipeV) share a plan only at equal in-flight
    pairs: their key is made without rounding, and making it does not rebuild their memory
    spec without its activation factor (which StageMemory refuses)."""
    from types import SimpleNamespace

    from autopp.plan.stage_classes import class_key
    from autopp.sharding.request import StageMemory

    def req(pairs, f=4.0):
        return SimpleNamespace(
            memory=StageMemory(budget_bytes=1e9, activation_factor=f, split_in_flight=pairs),
            example_inputs=(), input_placements="default", output_placements="default",
            keyword_inputs={}, mixed_precision=None, tf32=False, param_placements={},
            microbatches_per_grad_reduce=4, time_limit_s=60.0, optimality_gap=None, reuse_blocks=True,
            mesh=SimpleNamespace(shape=(2, 1)), profile="H100", comm_windows_s=(0.0, 0.0))

    a, b, c = req(((4, 1),)), req(((4, 1),)), req(((3, 2),))
    assert class_key(a, ("s",)) == class_key(b, ("s",)) != class_key(c, ("s",))
    assert class_key(req(((4, 1),), f=3.0), ("s",)) != class_key(a, ("s",))
    assert class_key(a, None) is None
