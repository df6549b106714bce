"""Count the collectives a graph stage really runs, by schedule action and by what they read.

:class:`CollectiveCounter` is a ``TorchDispatchMode`` that sees every op the stage graphs
run (graphs call ``_c10d_functional`` ops like any other) and counts the collectives among
them. It also follows which tensors are computed from parameters alone (a parameter shard,
its cast, view, clone or gather): a collective whose inputs are all such tensors reads
parameters (an all-gather of weights), any other reads activations or gradients. This is
what shows, from the running pipeline rather than from the graphs, that weights are
gathered once per step at UNSHARD and never inside a microbatch's forward or backward.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autopp._compat.distributed import TorchDispatchMode, tree_leaves

_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                "all_to_all_single", "broadcast")


class CollectiveCounter(TorchDispatchMode):
    """Counts ``_c10d_functional`` collectives while active.

    ``counts[(label, op, reads_params)]``: how many ``op`` collectives ran while ``label``
    was set (see :meth:`labelled`), and whether their inputs were computed from parameters
    alone. Register parameters with :meth:`mark_params` (the tensors handed to the graphs).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str, bool]] = collections.Counter()
        self.label = ""
        self._from_params: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def mark_params(self, tensors: list[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._from_params[t] = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        from_params = bool(ins) and all(t in self._from_params for t in ins)
        if from_params:
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self._from_params[o] = True
        ns = getattr(func, "namespace", None)
        name = getattr(func, "_opname", "")
        if ns == "_c10d_functional" and name in _COLLECTIVES:
            self.counts[(self.label, name, from_params)] += 1
        return out

    def summary(self) -> dict[str, int]:
        """``{"UNSHARD all_gather_into_tensor params": n, "F all_reduce": m, ...}``."""
        return {f"{label} {op}{' params' if p else ''}": n
                for (label, op, p), n in sorted(self.counts.items())}
