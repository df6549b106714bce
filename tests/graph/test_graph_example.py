"""examples/simplefsdp_pp.py: SimpleFSDP stages (pp=2 x dp=2, 4 gloo processes) match one process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.harness.launch import run_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_simplefsdp_pp_example_matches_single_process():
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # a non-zero exit raises, with the output's last lines
    out = run_command(
        [str(torchrun), "--standalone", "--nproc-per-node", "4",
         str(ROOT / "examples" / "simplefsdp_pp.py"), "--check", "--schedule", "ZBVZeroBubble"],
        cwd=ROOT, env=env, timeout=600,
    )
    assert out.count(" OK") == 4, out[-4000:]
    assert "unshard" in out and "reduce_grad" in out and "backward_weight" in out
