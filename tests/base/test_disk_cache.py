"""The on-disk cache under the plan and profile caches (``autopp.disk_cache``): a full cache
that cannot be written serves its entries; an unwritable empty one computes uncached with
one warning; two processes asking for one key at once compute it once.

"Cannot be written" is made real without root's privileges being in the way: the lock file
cannot be opened (``open`` raising EROFS, as on a read-only mount), or the cache directory
cannot exist (its parent is a file)."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import time
from pathlib import Path

import pytest

from autopp import disk_cache


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _save(value: dict, path: Path) -> None:
    path.write_text(json.dumps(value))


def _read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


def test_a_read_only_cache_serves_what_it_holds(tmp_path, monkeypatch):
    value, hit = disk_cache.cached_file(tmp_path, "k", lambda: {"plan": 1}, _load, _save)
    assert (value, hit) == ({"plan": 1}, False)
    monkeypatch.setattr(disk_cache, "open", _read_only, raising=False)  # no lock can be taken

    def solve():
        raise AssertionError("a cached entry must not be solved again")

    assert disk_cache.cached_file(tmp_path, "k", solve, _load, _save) == ({"plan": 1}, True)


def test_an_unwritable_cache_computes_uncached_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_cache, "_WARNED", set())
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    calls = []
    with caplog.at_level(logging.WARNING, logger="autopp.disk_cache"):
        for _ in range(2):  # the cache directory cannot be created under a file
            got = disk_cache.cached_file(blocked / "cache", "k", lambda: calls.append(1) or {"v": 2},
                                         _load, _save)
            assert got == ({"v": 2}, False)
        monkeypatch.setattr(disk_cache, "open", _read_only, raising=False)
        assert disk_cache.cached_file(tmp_path / "ro", "k", lambda: {"v": 3}, _load, _save) == (
            {"v": 3}, False)
    assert len(calls) == 2  # nothing was cached
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one per directory
    assert "cannot be written" in warnings[0] and "computing without caching" in warnings[0]


def _solve_slowly(d: str, counter: str, out) -> None:
    def solve():
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(1.0)
        return {"v": 4}

    out.put(disk_cache.cached_file(Path(d), "k", solve, _load, _save))


def test_two_processes_sharing_a_cache_solve_a_key_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    counter = tmp_path / "solves"
    procs = [ctx.Process(target=_solve_slowly, args=(str(tmp_path / "c"), str(counter), out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=60) for _ in procs), key=lambda r: r[1])
    for p in procs:
        p.join(timeout=60)
    assert counter.read_text() == "x"
    assert results == [({"v": 4}, False), ({"v": 4}, True)]


def test_cache_entries_are_complete_when_present(tmp_path):
    """An entry appears only by rename: a solve that fails leaves no entry behind."""
    def solve():
        raise RuntimeError("planner failed")

    with pytest.raises(RuntimeError):
        disk_cache.cached_file(tmp_path, "k", solve, _load, _save)
    assert not (tmp_path / "k.json").exists()
    assert not list(tmp_path.glob("*.tmp"))
