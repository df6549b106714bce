"""``dry_run(..., example_kwargs=...)`` and ``plan_pipeline(..., example_kwargs=...)``: a
padding mask is planned for, as ``pipeline_autoparallel(..., example_kwargs=...)`` plans for
it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = r"""
import json, torch
from tests.harness.models import hf_llama_meta
from autopp.dry_run import dry_run

model = hf_llama_meta(2)
mask = torch.ones(4, 32, dtype=torch.long, device="meta")  # one dp rank's batch (8 // dp 2)
r = dry_run(model, pp=2, dp=2, tp=1, schedule="1F1B", n_microbatches=2, global_batch=8,
            seq_len=32, example_kwargs={"attention_mask": mask})
out = dict(plan=[[n, list(s), d] for n, s, d in r.plan.keyword_inputs],
           stages=[[[n, list(s), d] for n, s, d in p.keyword_inputs]
                   for p in r.plan.stage_plans],
           describe=r.plan.describe(), step=r.step_time_s,
           act=[s.activation_bytes for s in r.stages])
try:
    dry_run(hf_llama_meta(2), pp=2, dp=2, tp=1, n_microbatches=2, global_batch=8,
            seq_len=32, activations=False,
            example_kwargs={"attention_mask": torch.ones(3, 32, device="meta")})
except ValueError as e:
    out["refused"] = str(e)
from autopp import plan_pipeline
plan = plan_pipeline(hf_llama_meta(2), pp=2, dp=2, tp=1, schedule="1F1B", n_microbatches=2,
                     global_batch=8, seq_len=32, example_kwargs={"attention_mask": mask})
out["plan_pipeline"] = [[n, list(s), d] for n, s, d in plan.keyword_inputs]
out["plan_pipeline_stages"] = [[[n, list(s), d] for n, s, d in p.keyword_inputs]
                               for p in plan.stage_plans]
out["without"] = plan.mismatches(keyword_inputs={})
print("JSON" + json.dumps(out))
"""


def test_a_dry_run_and_plan_pipeline_plan_for_a_padding_mask(tmp_path):
    """Every stage is planned with the mask as a keyword input of its microbatch
    (dp-global: 8 / 2 microbatches = 4 rows), the pipeline plan records one dp rank's (4
    rows) and its ``describe()`` names it; a mask not batched like the inputs is refused as
    ``pipeline_autoparallel`` refuses it. ``plan_pipeline`` plans and records the same, and
    its plan differs from a pipeline built without the mask."""
    env = dict(os.environ, AUTOPP_PLAN_CACHE=str(tmp_path / "plans"))
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])
    assert out["plan"] == [["attention_mask", [4, 32], "torch.int64"]]
    assert out["stages"] == [[["attention_mask", [4, 32], "torch.int64"]]] * 2
    assert "attention_mask=[4, 32] torch.int64" in out["describe"].splitlines()[0]
    assert out["step"] > 0 and all(a and a > 0 for a in out["act"]), out
    assert "example_kwargs['attention_mask'] is a tensor of shape (3, 32)" in out["refused"]
    assert out["plan_pipeline"] == out["plan"] and out["plan_pipeline_stages"] == out["stages"]
    assert out["without"] == ["keyword inputs (name, shape, dtype): the plan has "
                              "[['attention_mask', [4, 32], 'torch.int64']], this pipeline []"]
