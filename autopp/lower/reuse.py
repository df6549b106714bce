"""Lowered stages reused within a process.

Lowering (``make_fx`` over DTensor dispatch) is most of a rank's build time, and a process
often builds the same stage again (an eval pipeline, a pipeline to load a checkpoint into,
another schedule with the same plans). :func:`lowered_stage` keeps the last lowerings (and
their splits, :func:`split_stage`, per recompute mode) and serves a stage whose key matches.

The key is what a lowering depends on: each unit's graph signature and plan placements, the
stage's boundary placements, the device, and this rank's place in the mesh (local shapes are
baked in). Not the process groups' names, which a new mesh renews: a reused graph's
collectives are re-pointed at the current mesh's group with the same ranks, so it
communicates exactly as a fresh lowering would; where that match is not unique, the stage is
lowered again."""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import fx

from autopp._compat import sharding as compat
from autopp.graph import Recompute, StageGraphs
from autopp.lower.local_graphs import (
    LocalJoint,
    LoweredUnit,
    lower_stage,
    mesh_device,
    split_local,
)
from autopp.sharding.plan import to_strs

logger = logging.getLogger(__name__)

#: Lowerings kept per process (each a graph of a stage's ops with fake-tensor metadata; no
#: tensor data).
CAPACITY = 16


@dataclasses.dataclass(slots=True)
class _Entry:
    local: LocalJoint
    groups: dict[str, tuple[int, ...]]
    """The process groups ``local``'s collectives name, with their ranks."""
    splits: dict[tuple[str, bool], StageGraphs] = dataclasses.field(default_factory=dict)
    """``local`` split by (recompute mode, overlap)."""


_GRAPH_FIELDS = ("forward_graph", "full_backward_graph", "backward_input_graph",
                 "backward_weight_graph", "unshard_graph", "reduce_grad_graph")

_lowered: OrderedDict[tuple, _Entry] = OrderedDict()
#: A served lowering's graph module -> its entry and the group renaming it got.
_served: weakref.WeakKeyDictionary[fx.GraphModule, tuple[_Entry, dict[str, str]]] = (
    weakref.WeakKeyDictionary())
_stats = {"hits": 0, "misses": 0}


def lowered_stage(units: Sequence[LoweredUnit], mesh: Any, in_placements: tuple,
                  out_placements: tuple) -> LocalJoint:
    """:func:`~autopp.lower.local_graphs.lower_stage` of ``units`` on ``mesh``, served from
    this process's earlier lowerings where one has the same key (see the module's
    docstring), with this call's FQNs and process groups."""
    key = _key(units, mesh, in_placements, out_placements)
    p_fqns = tuple(f for u in units for f in u.param_fqns)
    b_fqns = tuple(f for u in units for f in u.buffer_fqns)
    entry = _lowered.get(key)
    rename = None if entry is None else _renaming(entry.groups, _mesh_groups(mesh))
    if rename is not None:
        _lowered.move_to_end(key)
        _stats["hits"] += 1
        logger.debug("lowered stage reused (%d units)", len(units))
        local = dataclasses.replace(entry.local, gm=_regroup(entry.local.gm, rename),
                                    param_fqns=p_fqns, buffer_fqns=b_fqns)
    else:
        _stats["misses"] += 1
        local = lower_stage(units, mesh, in_placements, out_placements)
        entry = _Entry(local, {name: compat.group_ranks(name) for name in _group_names(local.gm)})
        rename = {}
        _lowered[key] = entry
        while len(_lowered) > CAPACITY:
            _lowered.popitem(last=False)
    _served[local.gm] = (entry, rename)
    return local


def split_stage(local: LocalJoint, *, recompute: Recompute, overlap: bool) -> StageGraphs:
    """:func:`~autopp.lower.local_graphs.split_local` of ``local``, once per lowering and
    (``recompute``, ``overlap``) where ``local`` came from :func:`lowered_stage` (the
    pieces' collectives re-pointed as ``local``'s are); a fresh ``runners`` dict each call."""
    served = _served.get(local.gm)
    if served is None:
        return split_local(local, recompute=recompute, overlap=overlap)
    entry, rename = served
    base = entry.splits.get((recompute, overlap))
    if base is None:
        base = split_local(entry.local, recompute=recompute, overlap=overlap)
        entry.splits[recompute, overlap] = base
    pieces = {f: _regroup(getattr(base, f), rename) for f in _GRAPH_FIELDS
              if getattr(base, f) is not None}
    return dataclasses.replace(base, runners={}, **pieces)


def reuse_stats() -> dict[str, int]:
    """``{"hits": ..., "misses": ...}`` of :func:`lowered_stage` in this process."""
    return dict(_stats)


def clear() -> None:
    """Forget every kept lowering (and the counts)."""
    _lowered.clear()
    _served.clear()
    _stats.update(hits=0, misses=0)


def _key(units: Sequence[LoweredUnit], mesh: Any, in_pl: tuple, out_pl: tuple) -> tuple:
    return (
        tuple((u.plan.signature, u.plan.nodes) for u in units),
        to_strs(tuple(in_pl)), to_strs(tuple(out_pl)),
        str(mesh_device(mesh)), tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()),
        tuple(mesh.mesh.flatten().tolist()), tuple(mesh.get_coordinate() or ()),
    )


def _group_arg(node: fx.Node) -> tuple[int | str, str] | None:
    """(position or keyword, value) of ``node``'s ``group_name`` argument, if it has one."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_name":
            if i < len(node.args):
                return i, node.args[i]
            if "group_name" in node.kwargs:
                return "group_name", node.kwargs["group_name"]
    return None


def _group_names(gm: fx.GraphModule) -> set[str]:
    names = set()
    for node in gm.graph.nodes:
        found = _group_arg(node)
        if found is not None and isinstance(found[1], str) and found[1]:
            names.add(found[1])
    return names


def _mesh_groups(mesh: Any) -> dict[tuple[int, ...], list[str]]:
    """This rank's groups of ``mesh`` (one per dim, and those of dims flattened on its root
    mesh), by their ranks."""
    groups: dict[tuple[int, ...], list[str]] = {}
    names = [mesh.get_group(i).group_name for i in range(mesh.ndim)]
    for name in names + compat.flattened_group_names(mesh):
        ranks = compat.group_ranks(name)
        if name not in groups.setdefault(ranks, []):
            groups[ranks].append(name)
    return groups


def _renaming(groups: dict[str, tuple[int, ...]],
              current: dict[tuple[int, ...], list[str]]) -> dict[str, str] | None:
    """Old group name -> the current group with the same ranks, for every group in ``groups``
    that is not current; None where a group has no unique current match."""
    rename = {}
    for name, ranks in groups.items():
        match = current.get(ranks, [])
        if len(match) != 1:
            return None
        if match[0] != name:
            rename[name] = match[0]
    return rename


def _regroup(gm: fx.GraphModule, rename: dict[str, str]) -> fx.GraphModule:
    """``gm`` with its collectives' group names renamed (``gm`` itself where none is)."""
    if not rename or not _group_names(gm) & set(rename):
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        found = _group_arg(node)
        if found is None or found[1] not in rename:
            continue
        where, old = found
        if isinstance(where, int):
            node.args = (*node.args[:where], rename[old], *node.args[where + 1:])
        else:
            node.kwargs = {**node.kwargs, "group_name": rename[old]}
    return fx.GraphModule(gm, graph)
