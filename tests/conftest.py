"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the test command runs two workers), every ``multiprocess`` test
    (one launch of several gloo processes) goes to one worker, one launch at a time, while
    the other worker runs the single-process tests beside it: two launches at once would
    put 16 processes on two cores and twice the memory. They are collected first, so that
    longest chain of tests starts at once."""
    # collection runs on the workers, where xdist has reset ``numprocesses`` to None and
    # kept ``--dist loadgroup`` as ``option.loadgroup`` (xdist/remote.py:setup_config)
    if not getattr(config.option, "loadgroup", False):
        return
    launches = [i for i in items if i.get_closest_marker("multiprocess")]
    # the launches planned ahead (tests/harness/plan_ahead.py) last: their plans are made meanwhile
    from tests.harness.plan_ahead import AHEAD

    launches.sort(key=lambda i: i.nodeid.removesuffix("@launches") in AHEAD)
    for item in launches:
        item.add_marker(pytest.mark.xdist_group("launches"))
    chosen = set(map(id, launches))
    items[:] = launches + [i for i in items if id(i) not in chosen]
    if launches and not config.pluginmanager.has_plugin("autopp-launch-check"):
        config.pluginmanager.register(_LaunchGroupCheck(launches), "autopp-launch-check")


class _LaunchGroupCheck:
    """After xdist's own collection hook: the launches carry its group, or the scheduler
    would spread them over both workers (two 8-process launches at once, as on pytest 9.2
    with xdist 3.8: pytest-dev/pytest-xdist#1386), which this refuses."""

    def __init__(self, launches):
        self.launches = launches

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        ungrouped = [i.nodeid for i in self.launches if not i.nodeid.endswith("@launches")]
        if ungrouped:
            raise pytest.UsageError(
                f"pytest-xdist did not group {len(ungrouped)} multiprocess tests (e.g. "
                f"{ungrouped[0]}): with pytest {pytest.__version__} --dist loadgroup does not "
                "group; reinstall the pinned test dependencies (bash scripts/env.sh) or run "
                "AUTOPP_TEST_WORKERS=0 bash scripts/test.sh")


def _cache_root(basetemp: Path) -> Path:
    """The session's plan and profile caches: one directory for the controller and every
    pytest-xdist worker (a worker's basetemp is inside the controller's)."""
    return basetemp / "autopp-cache"


def pytest_sessionstart(session):
    """Under pytest-xdist, the controller starts ``python -m tests.harness.plan_ahead`` (the slowest
    launches' plans made beside the suite) with the session's caches; its output goes to
    ``plan_ahead.log`` there. AUTOPP_TEST_PLAN_AHEAD=0 turns it off."""
    config = session.config
    # the controller sees ``--dist loadgroup`` as option.dist (its workers as loadgroup)
    if (os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "dist", "") != "loadgroup"
            or os.environ.get("AUTOPP_TEST_PLAN_AHEAD") == "0"):
        return
    import subprocess
    import sys

    root = _cache_root(config._tmp_path_factory.getbasetemp())
    root.mkdir(exist_ok=True)
    env = dict(os.environ)
    for var, sub in (("AUTOPP_PLAN_CACHE", "plans"), ("AUTOPP_PROFILE_CACHE", "profiles")):
        env.setdefault(var, str(root / sub))
    log = open(root / "plan_ahead.log", "w")
    config._autopp_plan_ahead = subprocess.Popen(
        [sys.executable, "-m", "tests.harness.plan_ahead"], env=env, stdout=log,
        stderr=subprocess.STDOUT, cwd=str(config.rootpath))


def pytest_sessionfinish(session):
    ahead = getattr(session.config, "_autopp_plan_ahead", None)
    if ahead is not None and ahead.poll() is None:
        ahead.kill()
        ahead.wait()


@pytest.fixture(scope="session", autouse=True)
def session_caches(tmp_path_factory):
    """One plan cache and one profile cache for the whole session (a plan made by one test
    is read by the next), in the session's temporary directory: the suite neither reads nor
    fills the user's ``~/.cache/autopp``. ``AUTOPP_PLAN_CACHE`` / ``AUTOPP_PROFILE_CACHE``
    set by the caller are kept. Under pytest-xdist the workers share one cache (the run's
    common temporary directory; concurrent writers are safe, see :mod:`autopp.disk_cache`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = _cache_root(tmp_path_factory.getbasetemp().parent)
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


