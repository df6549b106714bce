"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def fresh_plan_cache(tmp_path_factory):
    """An empty on-disk plan cache for the module (``AUTOPP_PLAN_CACHE``): its tests plan."""
    old = os.environ.get("AUTOPP_PLAN_CACHE")
    os.environ["AUTOPP_PLAN_CACHE"] = str(tmp_path_factory.mktemp("plans"))
    yield
    if old is None:
        os.environ.pop("AUTOPP_PLAN_CACHE")
    else:
        os.environ["AUTOPP_PLAN_CACHE"] = old
