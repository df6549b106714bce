"""One value per key in a directory of JSON files, safe for concurrent processes: the on-disk
store under the plan cache (:mod:`autopp.plan.cache`) and the measured-profile cache
(:mod:`autopp.profiles.measure`)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def cached_file(d: Path, key: str, solve: Callable[[], T], load: Callable[[Path], T],
                save: Callable[[T, Path], None]) -> tuple[T, bool]:
    """``load(d / f"{key}.json")``, or ``solve()``'s value saved there (written to a
    temporary file, then renamed); one process per host solves a key at a time (a lock file
    beside it). Returns ``(value, was_cached)``."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{key}.json"
    with open(d / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists():
                return load(path), True
            value = solve()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            save(value, tmp)
            tmp.replace(path)
            return value, False
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
