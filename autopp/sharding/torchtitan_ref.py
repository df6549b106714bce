"""torchtitan's hand-written FSDP+TP plan for llama3 blocks, priced under autopp's cost model.

torchtitan (``parallelize_llama``) shards every parameter on dim 0 over dp (FSDP2) and, over
tp, ``wq/wk/wv/wqkv/w1/w3`` colwise (``Shard(0)``), ``wo/w2`` rowwise (``Shard(1)``) and the
norms replicated (sequence parallel keeps their activations sharded on the sequence dim).
We fix the parameters to those placements and let the solver pick the activation placements
(so their estimate is the best their parameter layout can reach under our model), then
compare with autopp's own plan under the memory budget their layout uses.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autopp._compat import sharding as compat
from autopp.sharding.plan import StagePlan
from autopp.sharding.planner import plan_stage

COLWISE = ("wq", "wk", "wv", "wqkv", "w1", "w3")
ROWWISE = ("wo", "w2")


def torchtitan_param_placements(module: nn.Module, mesh_dim_names: tuple[str, ...]) -> dict:
    """FQN -> placement per mesh dim, as torchtitan's FSDP+TP plan lays llama3 out."""
    out = {}
    for fqn, p in module.named_parameters():
        owner = fqn.split(".")[-2] if "." in fqn else ""
        spec = []
        for name in mesh_dim_names:
            if name == "dp":
                spec.append(compat.Shard(0))
            elif name == "tp" and owner in COLWISE:
                spec.append(compat.Shard(0))
            elif name == "tp" and owner in ROWWISE:
                spec.append(compat.Shard(1))
            else:
                spec.append(compat.Replicate())
        out[fqn] = tuple(spec)
    return out


def compare_with_torchtitan(
    module: nn.Module, example_inputs: tuple[Any, ...], mesh, **plan_kwargs: Any
) -> tuple[StagePlan, StagePlan]:
    """(autopp's plan, torchtitan's plan) for the same stage under the same cost model.

    autopp plans under a parameter-memory budget equal to what torchtitan's layout uses per
    device (so both are FSDP-sized); torchtitan's activations are re-optimised by our solver.
    """
    names = tuple(mesh.mesh_dim_names)
    theirs = plan_stage(
        module,
        example_inputs,
        mesh,
        param_placements=torchtitan_param_placements(module, names),
        **plan_kwargs,
    )
    factor = plan_kwargs.get("param_state_factor", 1.0)
    budget = plan_kwargs.pop("memory_budget_bytes", None)
    if budget is None:
        budget = theirs.param_bytes_per_device * factor * (1 + 1e-9)
    ours = plan_stage(module, example_inputs, mesh, memory_budget_bytes=budget, **plan_kwargs)
    return ours, theirs
