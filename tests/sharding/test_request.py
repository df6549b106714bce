"""A stage's planning request is one frozen value (:mod:`autopp.sharding.request`): the
profile resolved once, the memory spec checked on construction, and its key() the plan
cache key, the same for equal requests and another for any field that changes the plan."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

from autopp.profiles.devices import PROFILES
from autopp.sharding import StageMemory, StageRequest

MESH = types.SimpleNamespace(shape=(2, 2), mesh_dim_names=("dp", "tp"))


def _request(**fields) -> StageRequest:
    with torch.device("meta"):
        module = nn.Linear(8, 8)
    return StageRequest(module=module, example_inputs=(torch.empty(4, 8, device="meta"),),
                        mesh=MESH, **fields)


def test_a_request_is_frozen_with_its_profile_resolved():
    r = _request(profile="H100")
    assert r.profile is PROFILES["H100"] and isinstance(r.tf32, bool)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.reuse_blocks = False  # type: ignore[misc]
    assert r.key() == _request(profile=PROFILES["H100"], tf32=r.tf32).key()


def test_the_key_follows_every_field_that_changes_the_plan():
    base = _request()
    assert base.key() == _request().key()
    others = [
        base.replace(budget_bytes=1e6), base.replace(recompute="full"),
        base.replace(activation_factor=2.0), base.replace(output_placements=None),
        base.replace(microbatches_per_grad_reduce=4), base.replace(comm_windows_s=(1.0, 0.0)),
        base.replace(profile="A100"), base.replace(param_placements={"weight": ("S(0)", "R")}),
    ]
    keys = {r.key() for r in others}
    assert len(keys) == len(others) and base.key() not in keys


def test_the_memory_spec_is_checked_on_construction():
    with pytest.raises(ValueError, match="activation_factor"):
        StageMemory(split_in_flight=((1.0, 0.0),))
    with pytest.raises(ValueError, match="recompute"):
        StageMemory(recompute="sometimes")
    with pytest.raises(ValueError, match="without a budget"):
        StageMemory(price=1e-9, budget_bytes=1e6)
