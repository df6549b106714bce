"""Block reuse: plan each distinct block once per boundary pair, then chain by DP.

A stage cut into units (:mod:`autopp.tracing.units`: pre part, blocks, post part) is
planned as follows:

1. group units by a structural signature (module types, parameter shapes and dtypes), so a
   stack of 8 identical blocks is traced and enumerated once;
2. for each distinct block and each pair (a, b) of boundary placements from a small set
   ``B`` (batch on dp; replicated or sequence-sharded elsewhere), solve the block's ILP with
   the block input fixed to ``a`` and its output to ``b``: cost ``C(a, b)``;
3. choose the boundary placements along the chain by dynamic programming
   (``min Σ_i C_i(b_{i-1}, b_i)`` with the stage's input/output constraints at the ends).

Planning time is ``|B|² × (one block ILP)`` per distinct block, independent of depth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from autopp._compat import sharding as compat
from autopp.sharding.options.option import PlacementSpec, matches
from autopp.sharding.ilp.solution import InfeasiblePlanError, SolveResult
from autopp.sharding.options.strategies import Strategies, enumerate_strategies
from autopp.tracing.joint import JointGraph
from autopp.tracing.units import BlockCall, default_extra_args, module_signature


@dataclass(slots=True)
class TracedBlock:
    module: nn.Module
    joint: JointGraph
    strategies: Strategies
    signature: tuple


def trace_unit(unit_module: nn.Module, x: torch.Tensor, mesh,
               inputs: Sequence[torch.Tensor] = (), *, param_dtype: str | None = None
               ) -> TracedBlock:
    """Trace and enumerate one unit called on ``x`` (meta, global shape) and the keyword
    inputs ``inputs`` (meta, in the units' order; never differentiated), its parameters
    computed in ``param_dtype`` (None: as stored). The trace comes through this process's
    trace cache (:func:`~autopp.tracing.cache.traced_unit`), as the estimates' and
    the stage build's traces of the planned unit do: a stage costed or built after it was
    planned here (the dry run's forked children, a job's rank 0) reuses it."""
    from autopp.tracing.precision import maybe_cast
    from autopp.tracing.cache import traced_unit

    joint = traced_unit(unit_module, (x, *inputs), param_dtype=param_dtype,
                        prepare=lambda m: maybe_cast(m, param_dtype), differentiable=1)
    module = maybe_cast(unit_module, param_dtype)
    sig = (type(module).__qualname__, module_signature(module))
    return TracedBlock(module, joint, enumerate_strategies(joint, mesh), sig)


def trace_block(block: nn.Module, x: torch.Tensor, mesh) -> TracedBlock:
    return trace_unit(BlockCall(block, default_extra_args(block)), x, mesh)


def boundary_candidates(
    traced: TracedBlock,
    mesh_dim_names: Sequence[str],
    spec: PlacementSpec | None = None,
    *,
    output: bool = False,
    pattern: bool = True,
) -> list[tuple]:
    """Block-boundary placements considered for a unit's input (or ``output``).

    With ``pattern``: batch on dp, each other dim R or S(1). ``spec`` (per mesh dim,
    None = any) narrows them further.
    """
    j = traced.joint
    node = j.tangents[0] if output else j.inputs[0]
    out = []
    for o in traced.strategies.nodes[node].options:
        pl = o.out[0]
        ok = not pattern or all(
            (p == compat.Shard(0) or n == 1) if name == "dp" else p in (compat.Replicate(), compat.Shard(1))
            for p, name, n in zip(pl, mesh_dim_names, traced.strategies.mesh_shape)
        )
        if spec is not None:
            ok = ok and matches(pl, spec)
        if ok and pl not in out:
            out.append(pl)
    return out


def block_restrictions(
    traced: TracedBlock,
    in_pl: PlacementSpec | None,
    out_pl: PlacementSpec | None,
    param_placements: dict[str, PlacementSpec] | None = None,
    keyword_pl: PlacementSpec | None = None,
) -> tuple[dict, dict]:
    """Node restrictions (and their names) fixing a unit's input, output and parameters,
    and its keyword inputs (every input after the first) to ``keyword_pl``: the step's
    keyword inputs reach each rank as its dp slice, whole over the other mesh dims."""
    j = traced.joint
    restrict, names = {}, {}
    if in_pl is not None and 0 in j.inputs:
        restrict[j.inputs[0]] = tuple(in_pl)
        names[j.inputs[0]] = "input_placements"
    for i, node in j.inputs.items():
        if i > 0 and keyword_pl is not None:
            restrict[node] = tuple(keyword_pl)
            names[node] = f"keyword input {i - 1}"
    if out_pl is not None and 0 in j.tangents:
        restrict[j.tangents[0]] = tuple(out_pl)
        names[j.tangents[0]] = "output_placements"
    for fqn, spec in (param_placements or {}).items():
        node = j.params.get(fqn) or j.params.get(f"block.{fqn}")
        if node is None:
            raise ValueError(f"param_placements names {fqn!r}, which is not a parameter")
        restrict[node] = tuple(spec)
        names[node] = f"param_placements[{fqn!r}]"
    return restrict, names


def chain_dp(
    kinds: Sequence[int],
    table: dict[int, dict[tuple, SolveResult]],
    first_in: Sequence[tuple],
    last_out: Sequence[tuple],
) -> list[tuple[tuple, tuple]]:
    """Boundary pair of each block minimising the summed block objectives.

    ``kinds[i]`` indexes the distinct block of position i; ``table[kind][(a, b)]`` its solution
    with input ``a`` and output ``b`` (missing = infeasible).
    """
    inf = math.inf
    best: dict[tuple, tuple[float, list]] = {a: (0.0, []) for a in first_in}
    for i, kind in enumerate(kinds):
        nxt: dict[tuple, tuple[float, list]] = {}
        for (a, b), res in table[kind].items():
            if a not in best:
                continue
            if i == len(kinds) - 1 and b not in last_out:
                continue
            cost = best[a][0] + res.objective_s
            if cost < nxt.get(b, (inf, None))[0]:
                nxt[b] = (cost, best[a][1] + [(a, b)])
        best = nxt
    if not best:
        raise InfeasiblePlanError(
            "no chain of block boundary placements satisfies the stage's input/output "
            "placement constraints"
        )
    return min(best.values(), key=lambda v: v[0])[1]
