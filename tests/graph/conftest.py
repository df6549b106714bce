"""Fixtures of the graph tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from autopp import init_fake_world


@pytest.fixture
def fake_world2():
    """A fake process group of 2 ranks for the test (graphs with functional collectives)."""
    init_fake_world(2)
    try:
        yield
    finally:
        dist.destroy_process_group()
