"""The gloo heap race (docs/gloo_heap_race_upstream.md) and autopp's workaround for it
(autopp/_compat/gloo.py: one worker thread per gloo group).

The deterministic check runs a planned pp2 x dp2 pipeline under a preload that widens the
race's window (scripts/gloo_race/widen_race.c, built here with the system C compiler): clean
with the workaround; in the ``wide`` test, a crash without it, so the test keeps proving its
point on the torch in use (when that one passes cleanly, torch has the fix: set
``FIXED_IN``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness.workers import gloo_race as gloo_race_workers

ROOT = Path(__file__).resolve().parents[2]
#: Seconds of training steps in the default suite's check, and the most the wide test waits
#: for the crash (it came in seconds to tens of seconds when measured).
CLEAN_SECONDS = 20
CRASH_SECONDS = 180


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_gloo_group_gets_one_worker_thread():
    """After ``import autopp``: the world group, a new_group and the world mesh's groups
    have one worker thread; explicit options are kept; AUTOPP_GLOO_WORKAROUND=0 leaves
    torch's two."""
    code = """
        import datetime, torch, torch.distributed as dist
        import autopp
        from autopp._compat.gloo import worker_threads
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = autopp.build_world_mesh()
        g = dist.new_group([0], backend="gloo")
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._threads, opts._timeout = 3, datetime.timedelta(seconds=60)
        own = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
        print([worker_threads(), worker_threads(g), own.options._threads]
              + [worker_threads(mesh.get_group(d)) for d in range(3)])
    """
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "[1, 1, 3, 1, 1, 1]", out.stdout
    off = _python(code, env={**os.environ, "AUTOPP_GLOO_WORKAROUND": "0"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split("\n")[-2] == "[2, 2, 3, 2, 2, 2]", off.stdout


def test_a_world_group_made_before_autopp_is_warned_once():
    """A user's ``init_process_group("gloo")`` before ``import autopp`` keeps torch's two
    worker threads: build_world_mesh warns once, naming what avoids it; the mesh's own
    groups still get one."""
    out = _python("""
        import warnings, torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        import autopp
        from autopp._compat.gloo import worker_threads
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            autopp.build_world_mesh()
            mesh = autopp.build_world_mesh()
        print(len(seen)); print(seen[0].message)
        print([worker_threads()] + [worker_threads(mesh.get_group(d)) for d in range(3)])
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().split("\n")
    assert lines[0] == "1", out.stdout
    assert "a gloo process group with 2 worker threads" in lines[1]
    assert 'import autopp before dist.init_process_group("gloo")' in lines[1]
    assert lines[-1] == "[2, 1, 1, 1]", out.stdout


def test_torch_versions_with_the_race(monkeypatch):
    from autopp._compat import gloo

    monkeypatch.setattr(gloo, "FIXED_IN", (2, 15, 0))
    assert gloo.race_in("2.13.0+cpu") and gloo.race_in("2.14.1")
    assert not gloo.race_in("2.15.0") and not gloo.race_in("2.16.0a0+git1234")
    monkeypatch.setattr(gloo, "FIXED_IN", None)
    assert gloo.race_in("2.99.0")


@pytest.fixture(scope="module")
def widen_race(tmp_path_factory) -> str:
    """scripts/gloo_race/widen_race.c built with the system C compiler (skip without one)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build the race-widening preload")
    so = tmp_path_factory.mktemp("preload") / "widen_race.so"
    built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(so),
                            str(ROOT / "scripts/gloo_race/widen_race.c"), "-ldl"],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"the race-widening preload did not build with {cc}: {built.stderr}")
    return str(so)


def _pipeline_under_preload(so: str, seconds: int, workaround: bool):
    env = {**os.environ, "LD_PRELOAD": so, "AUTOPP_GLOO_WORKAROUND": "1" if workaround else "0"}
    return subprocess.run([sys.executable, "-m", "tests.harness.workers.gloo_race", str(seconds)],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=seconds + 900)


@pytest.mark.multiprocess
def test_a_planned_pipeline_survives_the_widened_race(widen_race):
    """pp2 x dp2, overlap on, under the preload, with the workaround: no crash, and every
    group of the mesh runs one gloo worker thread."""
    out = _pipeline_under_preload(widen_race, CLEAN_SECONDS, workaround=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "gloo worker threads: world 1, mesh [1, 1, 1]" in out.stdout, out.stdout
    steps = int(out.stdout.split("clean: ")[1].split(" steps")[0])
    assert steps >= gloo_race_workers.MIN_STEPS, out.stdout


@pytest.mark.wide
@pytest.mark.multiprocess
def test_without_the_workaround_the_widened_race_crashes(widen_race):
    """The same run with torch's two worker threads per group dies of the race (glibc's heap
    check, a segmentation fault, or a worker left spinning on corrupted state until the
    launch's deadline): the check above proves something on this torch."""
    out = _pipeline_under_preload(widen_race, CRASH_SECONDS, workaround=False)
    assert out.returncode == 1, (
        f"no crash in {CRASH_SECONDS} s of steps without the workaround: if this torch "
        f"has the fix, set FIXED_IN in autopp/_compat/gloo.py\n{out.stdout[-3000:]}")
    assert "crash after" in out.stdout, out.stdout[-6000:]
    assert "exited with code -" in out.stdout or "after every rank started passed" in out.stdout, \
        out.stdout[-6000:]
