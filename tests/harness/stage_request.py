"""The planner tests' way to ask :func:`autopp.sharding.plan_stage`: its request from the
flat keywords the tests use (the memory spec's by their old names)."""

from __future__ import annotations

from typing import Any

from autopp.sharding import StageMemory, StageRequest

_RENAMED = {"memory_budget_bytes": "budget_bytes", "memory_price": "price"}
_MEMORY = {"budget_bytes", "activation_factor", "split_in_flight", "optimizer_state_factor",
           "largest_tensor_bytes", "recompute", "price", "weight_gathering",
           "prefetch_blocks"}


def stage_request(module: Any, example_inputs: tuple, mesh: Any, **fields: Any) -> StageRequest:
    """A :class:`StageRequest` for ``module`` on ``mesh``; ``fields`` by field name, the
    memory spec's among them (``memory_budget_bytes``, ``memory_price``: its budget, price)."""
    fields = {_RENAMED.get(k, k): v for k, v in fields.items()}
    memory = StageMemory(**{k: fields.pop(k) for k in list(fields) if k in _MEMORY})
    if fields.get("param_placements") is None:
        fields.pop("param_placements", None)
    if fields.get("keyword_inputs") is None:
        fields.pop("keyword_inputs", None)
    return StageRequest(module=module, example_inputs=example_inputs, mesh=mesh, memory=memory,
                        **fields)
