"""Python's cyclic garbage collector held off the heap that exists before planning starts.

Planning allocates millions of small objects, and each oldest-generation collection walks
every live object, torch's and torchtitan's imported modules included. :func:`frozen_heap`
moves what exists when planning starts to the permanent generation (:func:`gc.freeze`), so
collections walk only what planning made, and puts it back (:func:`gc.unfreeze`) when planning
ends: nothing leaks and the process collects as before afterwards. Forked stage planners
(:mod:`autopp.plan.parallel`) inherit the frozen heap, which also keeps the collector from
copying the pages they share. Nested uses act once, at the outermost level."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_depth = 0
_lock = threading.Lock()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Within: the objects alive on entry are not walked by the garbage collector."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
