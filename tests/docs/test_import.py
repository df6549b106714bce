"""``import autopp`` stays light: the planner, solver, graph machinery, torch's pipelining and
FSDP, DTensor and torchtitan load on first use, not at import (checked by module, not by
time: timings are noisy here; the note of the issue that asked reports the median)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("highspy", "torchtitan", "torch.distributed.pipelining", "torch.distributed.fsdp",
         "torch.distributed.tensor", "torch._functorch.aot_autograd", "autopp.sharding",
         "autopp.graph")


def test_import_autopp_loads_no_heavy_module():
    code = ("import sys, autopp; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out
