"""Numerics of an applied plan on gloo against the single-process module."""

import pytest

from tests.harness.launch import run_on_ranks
from tests.lower._apply_worker import apply_and_compare


@pytest.mark.multiprocess
@pytest.mark.wide  # the planned pipelines' parity tests run this path end to end
def test_planned_llama_stack_matches_single_process_on_2x2():
    dp, tp = 2, 2
    result = run_on_ranks(apply_and_compare, dp * tp, dp, tp, timeout=600)[0]
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
