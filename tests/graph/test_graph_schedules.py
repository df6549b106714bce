"""Graph stages on gloo (2 processes, one launch): Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV (eager, llama3 debugmodel layers) and InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV (Inductor, small MLP)
vs one process."""

from __future__ import annotations

import pytest

from tests.harness.launch import run_on_ranks
from tests.graph.graph_workers import run


@pytest.mark.multiprocess
def test_graph_stages_match_single_process_gradients():
    for lines in run_on_ranks(run, 2, timeout=900):
        assert len(lines) == 8, lines
        assert any("InterleavedZeroBubble" in l for l in lines)
        assert any("DualPipeV" in l for l in lines)
        assert sum("inductor" in l for l in lines) == 3, lines
