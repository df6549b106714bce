"""What differs between the torch versions autopp is tested with (2.13 and 2.14), each
checked where autopp meets it; ``-m compat`` (with the other ``compat`` tests) is the short
run ``scripts/check_torch.sh`` makes on the torch CI does not install."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.compat


def test_a_process_forked_after_a_fake_mode_backward_runs_a_backward():
    """torch 2.14.1 (CUDA build, no GPU) starts autograd device threads at a first backward
    under FakeTensorMode, and a forked child then refuses every backward (the search's probe
    processes, the stage planners); ``import autopp`` runs the first backward for real."""
    code = (
        "import os, torch, autopp\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "with FakeTensorMode():\n"
        "    x = torch.empty(3, requires_grad=True)\n"
        "    (x * 2).sum().backward()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    y = torch.ones(3, requires_grad=True)\n"
        "    (y * 2).sum().backward()\n"
        "    os._exit(0 if y.grad.tolist() == [2.0, 2.0, 2.0] else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_strided_shard_sizes_inside_a_fake_mode_trace():
    """torch 2.14's redistribution costs ask a strided shard's local size inside autopp's
    fake-mode traces; torch computes it with an index tensor, which must stay real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopp._compat.sharding import StridedShard

    p = StridedShard(1, split_factor=80)
    want = p.local_shard_size_and_offset(10240, 8, 3)
    with FakeTensorMode():
        got = p.local_shard_size_and_offset(10240, 8, 3)
    assert got == want and want[0] == 1280
