"""Numerics of an applied plan on gloo against the single-process module."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_apply_worker.py")


@pytest.mark.multiprocess
@pytest.mark.wide  # the planned pipelines' parity tests run this path end to end
def test_planned_llama_stack_matches_single_process_on_2x2(tmp_path):
    dp, tp = 2, 2
    world = dp * tp
    init_file, out_file = tmp_path / "init", tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(init_file), str(out_file),
             str(dp), str(tp)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=170)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(l[-3000:] for l in logs)
    result = json.loads(out_file.read_text())
    for name, r in result.items():
        errs = r["errs"]
        assert len(errs) == 1 + r["num_params"], name  # output + every parameter
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}
        assert not bad, (name, bad, r["placements"])
        for loss, ref_loss in r["losses"]:  # AdamW steps on sharded vs single-process
            assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (name, r["losses"])
    # the budgeted plan really shards: no parameter is replicated on both mesh dims
    planned = result["planned_budget"]["placements"]
    assert all(pl != ["R", "R"] for pl in planned.values()), planned
    sp_blocks = result["sequence_parallel"]["blocks"]
    assert sp_blocks[0][0] == ["S(0)", "S(1)"] and sp_blocks[-1][1] == ["S(0)", "S(1)"]
    tt = result["torchtitan_layout"]["placements"]
    assert tt["layers.0.attention.wo.weight"] == ["S(0)", "S(1)"]
