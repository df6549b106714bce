"""Python's cyclic garbage collector held off the heap that exists before planning starts.

Planning allocates millions of small container objects (DTensor specs, fx nodes, cost
tuples), and each of CPython's oldest-generation collections walks every live object,
torch's and torchtitan's imported modules included. Measured on the 70B pp4 dry run (py-spy,
the parent process, 2-core machine): about 3 s of the run's samples were in
``gc_collect_main``. :func:`frozen_heap` moves what exists when planning starts to the
collector's permanent generation (:func:`gc.freeze`), so those collections walk only what
planning itself made, and puts it back (:func:`gc.unfreeze`) when planning ends: nothing is
leaked and the caller's process collects as before afterwards. The forked stage-planning
processes (:mod:`autopp.plan.parallel`) inherit the frozen heap, which also keeps the
collector from touching (and so copying) the pages they share with this process.

Nested uses (the dry run plans its pipeline, which plans under this too) act once, at the
outermost level.
"""

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
