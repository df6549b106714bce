"""Graph stages on gloo (2 processes, one launch): Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV (eager, llama3 debugmodel layers) and InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV (Inductor, small MLP)
vs one process."""

from __future__ import annotations

import os
import sys

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import graph_workers  # noqa: E402
from tests.dist_harness import free_port




@pytest.mark.multiprocess
def test_graph_stages_match_single_process_gradients(tmp_path):
    world = 2
    try:
        mp.spawn(graph_workers.main, args=(world, free_port(), str(tmp_path)), nprocs=world)
    except Exception:
        errs = [p.read_text() for p in sorted(tmp_path.glob("rank*.err"))]
        pytest.fail("worker failed:\n" + "\n".join(errs))
    for rank in range(world):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == 8, lines
        assert any("InterleavedZeroBubble" in l for l in lines)
        assert any("DualPipeV" in l for l in lines)
        assert sum("inductor" in l for l in lines) == 3, lines
