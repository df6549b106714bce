"""Fixtures of the single-process planner tests: the fake process group (256 ranks, no
devices), meshes over it, llama3's debugmodel on meta and stacks of its blocks.

A test folder's conftest.py imports the fixtures it serves; the folder is a package
(``__init__.py``), so the fake process group is torn down after that folder's tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

FAKE_WORLD = 256


@pytest.fixture(scope="package")
def fake_world():
    """A fake process group for the tests of the package whose conftest imports it, torn
    down after them."""
    from autopp.mesh import init_fake_world

    mine = False
    if not dist.is_initialized():
        init_fake_world(FAKE_WORLD)
        mine = True
    elif dist.get_world_size() < FAKE_WORLD:
        pytest.skip("another test left a smaller process group initialised")
    yield
    if mine:
        dist.destroy_process_group()


@pytest.fixture(scope="package")
def make_mesh(fake_world):
    """make_mesh(dp, tp) -> a ("dp", "tp") DeviceMesh over the first dp*tp fake ranks."""
    cache: dict = {}

    def make(dp: int, tp: int) -> DeviceMesh:
        if (dp, tp) not in cache:
            ranks = torch.arange(dp * tp).view(dp, tp)
            cache[dp, tp] = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"))
        return cache[dp, tp]

    return make


@pytest.fixture(scope="session")
def llama_debug():
    """torchtitan llama3 debugmodel with SDPA attention, on meta."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs["debugmodel"], "sdpa")
    with torch.device("meta"):
        return cfg.build()


class BlockStack(nn.Module):
    """A middle pipeline stage: the first ``n`` llama3 blocks, nothing else."""

    def __init__(self, model: nn.Module, n: int):
        super().__init__()
        self.layers = nn.ModuleDict({k: v for k, v in list(model.layers.items())[:n]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x, None, None)
        return x


@pytest.fixture(scope="session")
def stack_of(llama_debug):
    return lambda n: BlockStack(llama_debug, n)


class MLP(nn.Module):
    def __init__(self, d: int = 512, h: int = 2048):
        super().__init__()
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def mlp_meta():
    with torch.device("meta"):
        return MLP()
