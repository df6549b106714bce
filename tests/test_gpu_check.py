"""The prepared GPU check (``scripts/gpu_check.sh``) cannot rot: its carried plan loads and
matches the model it checks (default command), and its CPU mode runs every check end to
end on gloo (wide matrix)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "benchmarks" / "gpu_check_plan.json"


def test_the_carried_plan_matches_the_checked_model():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    from autopp import PipelinePlan
    from autopp.plan.value import model_fingerprint

    plan = PipelinePlan.load(PLAN)  # an older format is refused: remake it with --make-plan
    assert plan.model == model_fingerprint(gpu_check._model("cuda"))
    assert (plan.pp, plan.dp, plan.tp, plan.schedule) == (1, 1, 1, gpu_check.SCHEDULE)
    assert plan.input_shapes == ((*gpu_check.BATCH["cuda"],),)
    assert plan.estimates is not None and plan.options.profile == "H200"


@pytest.mark.wide
def test_cpu_mode_runs_every_check():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu", "--repeats", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for row in ("device", "attention", "parity", "checkpoint"):
        assert any(line.split()[:2] == [row, "ok"] for line in proc.stdout.splitlines()), out
