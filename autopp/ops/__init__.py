"""Ops with sharding rules and kernels of their own, which DTensor's registry does not give.

* :mod:`autopp.ops.attention`: ``autopp::sdpa`` and its backward, so attention stays one op
  in traced graphs, with a batch/heads sharding rule.
* :mod:`autopp.ops.experts`: ``autopp::routed_experts`` (a MoE layer's routed experts as one
  op), its expert-parallel rules, FLOP formulas and local kernel.
* :mod:`autopp.ops.expert_kernels`: their local kernels (grouped MLP, combine, the
  all-to-all token exchange).
* :mod:`autopp.ops.expert_dispatch`: the all-to-all dispatch offered to the planner (options,
  price, local run) through :mod:`autopp.sharding.op_hooks`.

Importing this package registers the ops, their tracing contexts (:mod:`autopp.tracing`) and
their planner hooks; ``import autopp`` does it first.
"""

from autopp.ops import attention, expert_dispatch, experts  # noqa: F401  (registration)
