"""torchtitan's own entry point trains through autopp (``autopp.integrations.torchtitan``).

One launch of ``python -m torchtitan.train --module autopp.integrations.torchtitan --config
llama3_debugmodel_autopp`` on 4 gloo processes (pp2 x dp2 x tp1, Interleaved1F1B, 4
microbatches, 3 steps): it must finish, print torchtitan's metrics line every step, log
autopp's simulated step, memory and tokens/s at startup and the predicted tps next to the
measured one from step 2 on, and give the losses measured at pp2 x dp2 x tp2 on 8
processes. autopp's initialisation depends on the parameter names only and the global batch
is the same at both layouts, so the losses agree to float rounding. (With the same initial
weights, torchtitan's own manual PP x FSDP x TP gives the same losses to the printed 5 decimals: see the integration's
docstring for the commands.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

#: Steps 1-3 of llama3 debugmodel under autopp at pp2 x dp2 x tp2 (8 gloo processes), init
#: seed 0, this registry's data (the byte tokenizer over the standard library's sources).
REFERENCE_LOSSES = [8.22838, 7.93350, 7.34924]


def _missing() -> str | None:
    for name in ("torchtitan.train", "tokenizers", "datasets"):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ImportError:
            return name
    return None


@pytest.mark.skipif(_missing() is not None,
                    reason=f"torchtitan's entry point needs {_missing()}, not installed")
def test_torchtitan_train_with_autopp(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--local-ranks-filter", "0", "-m", "torchtitan.train",
           "--module", "autopp.integrations.torchtitan", "--config", "llama3_debugmodel_autopp",
           "--training.steps", "3", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.data_parallel_shard_degree", "2",
           "--parallelism.tensor_parallel_degree", "1",
           "--dump_folder", str(tmp_path / "outputs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    from autopp.integrations.torchtitan.logs import read_metrics

    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, out[-6000:]
    assert "autopp plan:" in out and "autopp pipeline: 4 stages over pp=2" in out
    metrics = read_metrics(out)  # torchtitan's metrics line: loss, grad_norm, memory, tps...
    assert sorted(metrics) == [1, 2, 3], out[-6000:]
    losses = [metrics[s].loss for s in (1, 2, 3)]
    print("losses", losses)
    assert losses == pytest.approx(REFERENCE_LOSSES, abs=1e-4), losses
    # autopp's simulator at startup: the whole plan with its estimates and the summary line
    assert "estimated step" in out and "pp rank 1: peak" in out, out[-6000:]
    startup = re.search(r"autopp predicted \(profile CPU, schedule Interleaved1F1B simulated\): "
                        r"step ([\d.]+) ms, bubble [\d.]+%, tps ([\d,]+) per device.*"
                        r"peak memory per device ([\d.]+) MiB .*activations ([\d.]+)", out)
    assert startup, out[-6000:]
    step_ms, tps = float(startup[1]), float(startup[2].replace(",", ""))
    assert step_ms > 0 and float(startup[3]) > 0 and float(startup[4]) > 0
    # 4 sequences of 128 tokens per dp rank over pp x tp = 2 devices, per simulated step
    assert tps == pytest.approx(4 * 128 / 2 / (step_ms / 1e3), rel=1e-2)
    # predicted tps next to the measured one, after each metrics line but the first
    predicted = {int(m[1]): (float(m[2].replace(",", "")), float(m[3].replace(",", "")))
                 for m in re.finditer(r"step:\s*(\d+)\s+autopp tps predicted: ([\d,]+)\s+"
                                      r"measured: ([\d,]+)", out)}
    assert sorted(predicted) == [2, 3], out[-6000:]
    assert all(p == pytest.approx(tps, rel=1e-3) and m > 0 for p, m in predicted.values())
    assert "Training completed" in out
