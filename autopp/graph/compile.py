"""Optional Inductor compilation of a stage's callables."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autopp._compat import graph as _compat
from autopp.graph.callables import StageGraphs

ALL_CALLABLES = ("forward", "full_backward", "backward_input", "backward_weight",
                 "unshard", "reduce_grad")


def compile_stage_graphs(graphs: StageGraphs, which: Iterable[str] = ALL_CALLABLES,
                         options: dict[str, Any] | None = None) -> StageGraphs:
    """Compile the named callables of ``graphs`` with Inductor, in place; returns ``graphs``.

    Compilation is lazy: each callable compiles on its first call (a cold compile costs
    seconds). The FX graphs stay available in ``graphs.graphs()`` for inspection.
    ``options``: Inductor config keys for these compilations (``torch.compile(options=)``),
    e.g. ``{"bucket_all_gathers_fx": "all", "reorder_for_compute_comm_overlap": True}``.
    """
    present = graphs.graphs()
    unknown = set(which) - set(ALL_CALLABLES)
    if unknown:
        raise ValueError(f"unknown callables {sorted(unknown)}; choose from {ALL_CALLABLES}")
    for name in which:
        if name in present and name not in graphs.runners:
            graphs.runners[name] = _compat.inductor_compile(present[name], options)
    return graphs
