"""torch.distributed internals autopp uses: the fake process group's store, c10d's
per-group timeout setter, the functional collectives' wait, the dispatch mode base class,
the fake-tensor mode and pytree."""

from __future__ import annotations

from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401  (re-exported)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_leaves, tree_map  # noqa: F401  (re-exported)


def pickle_leaf_specs_plainly() -> None:
    """Pickle (and deep-copy) torch's leaf ``TreeSpec`` as a call of ``treespec_leaf()``, the
    same singleton. torch 2.13 reduces it to its deprecated ``LeafSpec`` class, which warns
    (FutureWarning) each time one is rebuilt: every plan a forked planning or probing process
    sends back, or a copy of a traced graph, printed dozens. Installed by ``import autopp``;
    idempotent; a torch without ``LeafSpec`` needs nothing."""
    import copyreg

    from torch.utils import _pytree

    leaf, make = getattr(_pytree, "LeafSpec", None), getattr(_pytree, "treespec_leaf", None)
    if leaf is not None and make is not None:
        copyreg.pickle(leaf, lambda spec: (make, ()))


def wait_collective(t: Any) -> Any:
    """Wait for the functional collective that produced ``t`` (``_c10d_functional``'s
    ``wait_tensor``: on CUDA the current stream then waits for the collective's; a tensor
    already waited for is returned as it is)."""
    import torch

    return torch.ops._c10d_functional.wait_tensor(t)


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)`` (torch keeps it under testing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def set_pg_timeout(timeout: Any, group: Any = None) -> None:
    """c10d's timeout setter for one process group (torch 2.13 has no public one)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)
