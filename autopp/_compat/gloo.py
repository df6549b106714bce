"""One worker thread per gloo process group: autopp's workaround for a data race in torch's
``ProcessGroupGloo`` (docs/gloo_heap_race_upstream.md). A group's worker threads (torch's
default: two) each write the name of the collective they completed into one shared string
without a lock; two completions at once corrupt the heap ("malloc(): unaligned tcache chunk
detected", a segmentation fault, or a worker spinning forever). autopp's graphs keep several
collectives of a group in flight, which makes two completions at once likely.

:func:`install` makes the constructor torch calls for every gloo group it creates
(``ProcessGroupGloo(store, rank, size, timeout)``: init_process_group, new_group,
DeviceMesh) build the group with one worker thread; a call with explicit options is left as
it is. One worker still overlaps communication with compute, and runs a group's collectives in
the order every rank issued them. ``import autopp`` installs it; ``AUTOPP_GLOO_WORKAROUND=0``
leaves torch as it is. Delete this module once torch's floor has the fix (:data:`FIXED_IN`).
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

#: The first torch release whose ProcessGroupGloo updates its status under its work lock
#: (None: no release has the fix yet, so every torch autopp supports gets the workaround).
FIXED_IN: tuple[int, int, int] | None = None

#: Set to "0" to leave torch's gloo groups as torch makes them (e.g. to check a torch build).
ENV = "AUTOPP_GLOO_WORKAROUND"

#: The call that makes the world group with one worker thread, named by :func:`check_group`.
REMEDY = "import autopp before dist.init_process_group(\"gloo\")"

_installed = False
_warned = False


def race_in(version: str) -> bool:
    """Whether torch ``version`` (e.g. "2.13.0+cpu") has the race."""
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit()) or "0"
        parts.append(int(digits))
    return FIXED_IN is None or tuple(parts) < FIXED_IN


def wanted() -> bool:
    """Whether the workaround applies here: torch has the race, has gloo, and ENV is not 0."""
    import torch
    import torch.distributed as dist

    return (os.environ.get(ENV, "1") != "0" and race_in(torch.__version__)
            and dist.is_available() and dist.is_gloo_available())


def install() -> bool:
    """From now on every gloo group torch constructs by its default (timeout) constructor has
    one worker thread; its devices are torch's own choice (GLOO_SOCKET_IFNAME's interfaces,
    else the host's default). Idempotent; returns whether the workaround is in place."""
    global _installed
    if _installed or not wanted():
        return _installed
    from torch._C._distributed_c10d import ProcessGroupGloo

    torch_init = ProcessGroupGloo.__init__

    def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30), **kw):
        opts = ProcessGroupGloo._Options()
        if isinstance(timeout, ProcessGroupGloo._Options) or any(
                not hasattr(opts, k) for k in kw):  # the caller's options, or a keyword
            return torch_init(self, store, rank, size, timeout, **kw)  # this shim lacks
        for k, v in kw.items():  # e.g. torch 2.14's enable_reconfigure: an option field
            setattr(opts, k, v)
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        opts._devices = ([ProcessGroupGloo.create_device(interface=n) for n in names]
                         or [ProcessGroupGloo.create_default_device()])
        opts._threads = 1
        opts._timeout = timeout
        return torch_init(self, store, rank, size, opts)

    __init__.__doc__ = (f"torch's constructor with one worker thread per group (autopp: "
                        f"{__name__}).\n\n{torch_init.__doc__}")
    ProcessGroupGloo.__init__ = __init__
    _installed = True
    return True


def worker_threads(group: Any = None) -> int | None:
    """The gloo worker threads of ``group`` (None: the world group); None if it has no gloo
    backend (nccl, the fake process group)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    group = group if group is not None else dist.group.WORLD
    if group is None or torch.device("cpu") not in getattr(group, "_device_types", ()):
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    return backend.options._threads if isinstance(backend, ProcessGroupGloo) else None


def check_group(group: Any = None) -> bool:
    """Whether ``group`` (None: the world group) is a gloo group with more than one worker
    thread while the race is present (it was made before autopp was imported); the first
    time, a warning naming what avoids it."""
    global _warned
    n = worker_threads(group) if wanted() else None
    if n is None or n < 2:
        return False
    if not _warned:
        _warned = True
        warnings.warn(
            f"a gloo process group with {n} worker threads (made before autopp was imported): "
            f"torch's ProcessGroupGloo can corrupt the heap when two of its collectives finish "
            f"together (a crash: 'malloc(): unaligned tcache chunk detected' or a segmentation "
            f"fault). autopp makes its mesh's groups with one worker thread; {REMEDY} gives "
            f"every gloo group one (docs/gloo_heap_race_upstream.md).",
            RuntimeWarning, stacklevel=3)
    return True
