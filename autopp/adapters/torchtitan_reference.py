"""torchtitan's hand-written FSDP+TP plan for llama3 stages, priced under autopp's cost model.

Model knowledge (torchtitan's module names), so it lives with the adapters; the dry run's
and the benchmarks' "against torchtitan" columns read it.

torchtitan (``parallelize_llama``) shards every parameter on dim 0 over dp (FSDP2) and, over
tp, ``wq/wk/wv/wqkv/w1/w3`` colwise (``Shard(0)``), ``wo/w2`` rowwise (``Shard(1)``) and the
norms replicated (sequence parallel keeps their activations sharded on the sequence dim).
We fix the parameters to those placements and let the solver pick the activation placements
(so their estimate is the best their parameter layout can reach under our model), then
compare with autopp's own plan under the memory budget their layout uses.
"""

from __future__ import annotations

from torch import nn

from autopp._compat import sharding as compat
from autopp.sharding.plan import StagePlan
from autopp.sharding.planner import plan_stage
from autopp.sharding.request import StageRequest

COLWISE = ("wq", "wk", "wv", "wqkv", "w1", "w3")
ROWWISE = ("wo", "w2")
#: torchtitan's llama3 TP plan for the modules around the blocks: ``tok_embeddings``
#: RowwiseParallel (an Embedding's weight sharded on the vocabulary, dim 0) and the output
#: projection ColwiseParallel (weight dim 0); ``norm`` is replicated (sequence parallel).
VOCAB_SHARDED = ("tok_embeddings", "lm_head", "output")


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


def torchtitan_stage_placements(stage: nn.Module, mesh_dim_names: tuple[str, ...]) -> dict:
    """:func:`torchtitan_param_placements` of a whole llama3 stage, the embedding and the
    output projection included (their weights sharded on the vocabulary over dp and tp)."""
    out = torchtitan_param_placements(stage, mesh_dim_names)
    for fqn in out:
        if fqn.split(".")[0] in VOCAB_SHARDED:
            out[fqn] = tuple(compat.Shard(0) if n in ("dp", "tp") else compat.Replicate()
                             for n in mesh_dim_names)
    return out


def compare_with_torchtitan(request: StageRequest) -> tuple[StagePlan, StagePlan]:
    """(autopp's plan, torchtitan's plan) for the same stage under the same cost model.

    autopp plans under ``request``'s budget, or (none given) the parameter memory
    torchtitan's layout uses per device (so both are FSDP-sized); torchtitan's activations
    are re-optimised by our solver.
    """
    names = tuple(request.mesh.mesh_dim_names)
    theirs = plan_stage(request.replace(
        param_placements=torchtitan_param_placements(request.module, names)))
    budget = request.memory.budget_bytes
    if budget is None:
        budget = theirs.param_bytes_per_device * (1 + 1e-9)
    return plan_stage(request.replace(budget_bytes=budget)), theirs
