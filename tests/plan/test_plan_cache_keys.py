"""Plan cache keys that cannot go stale (``autopp.plan.cache``): a profile re-registered
under its name with other numbers and a changed forward each give a new key; the same
inputs give the same key. (A changed file under ``autopp/graph/``:
``tests/plan/test_pipeline_plan.py::test_cache_key_follows_the_boundary_planning_code``.)"""

from __future__ import annotations

import json

import torch
from torch import nn

from autopp.plan import cache


def _key(module: nn.Module, profile: str = "H100") -> str:
    x = torch.empty(4, 8, device="meta")
    return cache.plan_key(module, (x,), (2, 2), ("dp", "tp"), {"profile": profile})


def _block(scale: float) -> type:
    class Block(nn.Module):  # the same name and parameters each time; only forward differs
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(8, 8)

        if scale == 1.0:
            def forward(self, x):
                return self.w(x)
        else:
            def forward(self, x):
                return self.w(x) * 2.0

    return Block


def test_a_changed_forward_gets_a_new_key():
    one, two = _block(1.0), _block(2.0)
    assert one.__qualname__ == two.__qualname__
    with torch.device("meta"):
        a, b = one(), two()
    assert _key(a) == _key(one().to("meta"))
    assert _key(a) != _key(b)


def test_a_profile_re_registered_with_other_numbers_gets_a_new_key():
    from autopp.profiles.devices import PROFILES, register_profile, with_overrides

    with torch.device("meta"):
        m = _block(1.0)()
    register_profile(with_overrides(PROFILES["H100"], name="site-gpu"))
    before = _key(m, "site-gpu")
    assert before == _key(m, "site-gpu")
    register_profile(with_overrides(PROFILES["H100"], name="site-gpu", flops_bf16=2e15))
    assert _key(m, "site-gpu") != before
    assert cache.pipeline_plan_key({"options": {"profile": "site-gpu"}}) != \
        cache.pipeline_plan_key({"options": {"profile": "H100"}})


def test_a_changed_helper_beside_the_forward_gets_a_new_key(tmp_path, monkeypatch):
    """A block whose forward calls a function of its own file: editing that function (not
    the forward) gives a new key."""
    import importlib
    import sys

    src = tmp_path / "user_block.py"
    body = ("import torch\nfrom torch import nn\n\ndef helper(x):\n    return x {op}\n\n"
            "class UserBlock(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.w = nn.Linear(8, 8)\n\n    def forward(self, x):\n"
            "        return helper(self.w(x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = []
    for op in ("* 2.0", "+ 1.0"):
        src.write_text(body.format(op=op))
        sys.modules.pop("user_block", None)
        importlib.invalidate_caches()
        mod = importlib.import_module("user_block")
        with torch.device("meta"):
            keys.append(_key(mod.UserBlock()))
    sys.modules.pop("user_block", None)
    assert keys[0] != keys[1]


def test_the_tf32_setting_is_in_the_keys(monkeypatch):
    """torch's fp32 matmul precision changes the rate fp32 matmuls are priced at, so it is
    read where the options are formed and both keys change with it: the pipeline plan's
    (through ``PlanOptions.tf32``) and each stage plan's (``plan_local_stage``)."""
    import dataclasses
    import types

    from autopp.plan import local_stage
    from autopp.plan.options import PlannerOptions
    from autopp.plan.value import PlanOptions
    from autopp.sharding import StageRequest

    class Stop(Exception):
        pass

    keys: list[str] = []

    def capture(key, solve):
        keys.append(key)
        raise Stop

    monkeypatch.setattr(local_stage, "cached_plan", capture)
    with torch.device("meta"):
        m = _block(1.0)()
    sub_mesh = types.SimpleNamespace(shape=(2, 2), mesh_dim_names=("dp", "tp"))
    x = (torch.empty(4, 8, device="meta"),)
    pipeline_keys, flags = [], []
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            options = PlannerOptions(profile="H100")
            flags.append(options.tf32)
            record = PlanOptions.of(options, "H100")
            pipeline_keys.append(cache.pipeline_plan_key(
                {"options": dataclasses.asdict(record)}))
            try:
                local_stage.plan_local_stage(StageRequest(
                    module=m, example_inputs=x, mesh=sub_mesh, profile="H100"))
            except Stop:
                pass
    finally:
        torch.set_float32_matmul_precision(before)
    assert flags == [False, True, False]
    assert pipeline_keys[0] == pipeline_keys[2] != pipeline_keys[1]
    assert keys[0] == keys[2] != keys[1]


def test_the_optimality_gap_keys_the_pipeline_plan_and_a_saved_plan_records_it():
    """A whole plan solved to one gap is not served (nor run from a saved file without a
    word) where another gap is asked for: the gap is among the options a plan records."""
    import dataclasses

    from autopp.plan.options import PlannerOptions
    from autopp.plan.value import PlanOptions

    def key(gap):
        record = PlanOptions.of(PlannerOptions(profile="H100", optimality_gap=gap), "H100")
        return cache.pipeline_plan_key({"options": dataclasses.asdict(record)})

    assert len({key(None), key(0.05), key(0.001)}) == 3 and key(0.05) == key(0.05)
    saved = PlanOptions.of(PlannerOptions(profile="H100"), "H100")
    assert saved.optimality_gap is None
    assert PlanOptions(**json.loads(json.dumps(dataclasses.asdict(saved)))) == saved
    said = saved.conflicts(PlannerOptions(profile="H100", optimality_gap=0.05))
    assert [c for c in said if c.startswith("optimality_gap")], said
    assert saved.conflicts(PlannerOptions(profile="H100")) == []
