"""One value per key in a directory of JSON files, safe for concurrent processes: the on-disk
store under the plan cache (:mod:`autopp.plan.cache`) and the measured-profile cache
(:mod:`autopp.profiles.measure`).

Entries are written to a temporary file and renamed into place, so a present entry is
always complete: it is read without a lock, and a read-only cache (a cluster's shared plans,
a container image) serves every entry it holds. A cache that cannot be written (read-only,
missing and not creatable, full) still answers: the value is computed and returned uncached,
with one warning per directory and process.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_unwritable(d: Path, err: OSError) -> None:
    if str(d) not in _WARNED:
        _WARNED.add(str(d))
        logger.warning("cache %s cannot be written (%s): computing without caching; "
                       "entries it holds are still read", d, err)


def cached_file(d: Path, key: str, solve: Callable[[], T], load: Callable[[Path], T],
                save: Callable[[T, Path], None]) -> tuple[T, bool]:
    """``load(d / f"{key}.json")``, or ``solve()``'s value saved there (written to a
    temporary file, then renamed); one process per host solves a key at a time (a lock file
    beside it). An unwritable cache gives ``solve()``'s value, uncached, with a warning.
    Returns ``(value, was_cached)``."""
    path = d / f"{key}.json"
    if path.exists():  # complete by construction (renamed into place): no lock needed
        return load(path), True
    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = open(d / f"{key}.lock", "w")
    except OSError as err:
        _warn_unwritable(d, err)
        return solve(), False
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.exists():  # another process solved it while this one waited
                return load(path), True
            value = solve()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            try:
                save(value, tmp)
                tmp.replace(path)
            except OSError as err:
                _warn_unwritable(d, err)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            return value, False
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
