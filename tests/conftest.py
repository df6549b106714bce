"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the test command runs two workers), every ``multiprocess`` test
    (one launch of several gloo processes) goes to one worker, one launch at a time, while
    the other worker runs the single-process tests beside it: two launches at once would
    put 16 processes on two cores and twice the memory. They are collected first, so that
    longest chain of tests starts at once."""
    if not config.pluginmanager.hasplugin("xdist") or not getattr(config.option, "numprocesses",
                                                                  None):
        return
    launches = [i for i in items if i.get_closest_marker("multiprocess")]
    for item in launches:
        item.add_marker(pytest.mark.xdist_group("launches"))
    chosen = set(map(id, launches))
    items[:] = launches + [i for i in items if id(i) not in chosen]


@pytest.fixture(scope="session", autouse=True)
def session_caches(tmp_path_factory):
    """One plan cache and one profile cache for the whole session (a plan made by one test
    is read by the next), in the session's temporary directory: the suite neither reads nor
    fills the user's ``~/.cache/autopp``. ``AUTOPP_PLAN_CACHE`` / ``AUTOPP_PROFILE_CACHE``
    set by the caller are kept. Under pytest-xdist the workers share one cache (the run's
    common temporary directory; concurrent writers are safe, see :mod:`autopp.disk_cache`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "autopp-cache"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("autopp-cache")
    for var, sub in (("AUTOPP_PLAN_CACHE", "plans"), ("AUTOPP_PROFILE_CACHE", "profiles")):
        os.environ.setdefault(var, str(root / sub))
    yield


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
