"""On-disk cache of plans, so a restart does not solve again.

Two kinds of entries, each keyed by everything it depends on: a stage's
:class:`~autopp.sharding.StagePlan` (:func:`plan_key`, :func:`cached_plan`: the stage
module's structure, input shapes and dtypes, the sub-mesh, the profile, the options) and a
whole :class:`~autopp.plan.value.PipelinePlan` (:func:`pipeline_plan_key`,
:func:`cached_pipeline_plan`: the model's fingerprint, split, placement, mesh, schedule,
microbatches, input shapes and options, without estimates). Both keys hold torch's version
and the hash of the planning code, made in :mod:`autopp.sharding.cache_key`. Processes on one
host that need the same entry take a file lock, so one solves and the others read. The
directory is ``$AUTOPP_PLAN_CACHE`` if set, else ``~/.cache/autopp/plans``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from autopp.disk_cache import cached_file
from autopp.sharding.cache_key import (  # noqa: F401 - the keys' home; named here too
    forward_code,
    pipeline_plan_key,
    plan_key,
    planner_source_files,
    profile_numbers,
)

if TYPE_CHECKING:
    from autopp.plan.value import PipelinePlan
    from autopp.sharding import StagePlan

T = TypeVar("T")
logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOPP_PLAN_CACHE", Path.home() / ".cache" / "autopp" / "plans"))


def _cached(key: str, solve: Callable[[], T], load: Callable[[Path], T],
            save: Callable[[T, Path], None]) -> tuple[T, bool]:
    return cached_file(cache_dir(), key, solve, load, save)


def evict(keys: Sequence[str], why: str) -> list[Path]:
    """Remove the entries ``keys`` from the plan cache (a plan that failed to apply: the
    next planning solves them again); logs a warning naming each entry removed and ``why``.
    Returns the files removed (an entry already gone, or a read-only cache, is skipped)."""
    removed = []
    for key in dict.fromkeys(keys):
        path = cache_dir() / f"{key}.json"
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as err:
            logger.warning("plan cache entry %s could not be evicted (%s)", path, err)
            continue
        removed.append(path)
    if removed:
        logger.warning("evicted %d plan cache entr%s (%s): %s", len(removed),
                       "y" if len(removed) == 1 else "ies", why,
                       ", ".join(p.name for p in removed))
    return removed


def cached_plan(key: str, solve: Callable[[], StagePlan]) -> tuple[StagePlan, bool]:
    """The stage plan stored under ``key``, or ``solve()``'s (stored for next time).

    Returns ``(plan, was_cached)``. One process per host solves a given key at a time.
    """
    from autopp.sharding import StagePlan

    return _cached(key, solve, StagePlan.load, lambda p, path: p.save(path))


def cached_pipeline_plan(key: str, solve: Callable[[], PipelinePlan]
                         ) -> tuple[PipelinePlan, bool]:
    """The whole pipeline plan stored under ``key`` (:func:`pipeline_plan_key`), or
    ``solve()``'s; as :func:`cached_plan`."""
    from autopp.plan.value import PipelinePlan

    return _cached(key, solve, PipelinePlan.load, lambda p, path: p.save(path))
