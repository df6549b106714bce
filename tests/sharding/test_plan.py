import torch

from autopp.sharding import StagePlan, plan_stage


def test_plan_json_round_trip_and_report(mlp_meta, make_mesh, tmp_path):
    x = torch.empty(8, 1024, 512, device="meta")
    plan = plan_stage(mlp_meta, (x,), make_mesh(2, 2), memory_budget_bytes=3e6)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert StagePlan.load(path) == plan
    text = str(plan)
    for needle in ("up.weight", "down.weight", "estimated step time", "Collectives",
                   "parameter memory per device", "Fallbacks", "none"):
        assert needle in text
    # every plan field is a plain value (hashable, immutable)
    hash(plan.params)
