import pytest
import torch

from autopp.adapters.torchtitan_reference import compare_with_torchtitan, torchtitan_param_placements
from tests.harness.stage_request import stage_request


@pytest.mark.parametrize("dp,tp,batch", [(2, 4, 8), (8, 8, 8), (32, 8, 32)])
def test_planned_no_worse_than_torchtitan(stack_of, make_mesh, dp, tp, batch):
    mesh = make_mesh(dp, tp)
    x = torch.empty(batch, 64, 256, device="meta")
    ours, theirs = compare_with_torchtitan(stage_request(stack_of(1), (x,), mesh, profile="H100"))
    expected = torchtitan_param_placements(stack_of(1), ("dp", "tp"))
    assert theirs.param_placements() == expected
    assert ours.param_bytes_per_device <= theirs.param_bytes_per_device * (1 + 1e-6)
    assert ours.step_time_s <= theirs.step_time_s * (1 + 1e-6)
    # FSDP-like: every weight matrix sharded over dp in our plan too (norms may differ)
    assert all(p.placements[0].startswith("S") for p in ours.params if "norm" not in p.fqn)
