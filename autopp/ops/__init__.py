"""Ops with sharding rules and kernels of their own, which DTensor's registry does not give.

* :mod:`autopp.ops.attention`: ``autopp::sdpa`` and its backward, so attention stays one op
  in traced graphs, with a batch/heads sharding rule.
* :mod:`autopp.ops.experts`: ``autopp::routed_experts`` (a MoE layer's routed experts as one
  op), its expert-parallel rules, FLOP formulas and local kernel.
* :mod:`autopp.ops.expert_kernels`: their local kernels (grouped MLP, combine, the
  all-to-all token exchange).

They depend on torch alone (and :mod:`autopp._compat`): the planner
(:mod:`autopp.sharding`) sits above them, traces SDPA as ``autopp::sdpa``
(:class:`~autopp.ops.attention.AttentionAsOneOp`) and offers the routed experts' all-to-all
dispatch through its op hooks (:mod:`autopp.sharding.options.expert_dispatch`).
"""

#: How routed experts may bring tokens to expert-parallel devices (``autopp::routed_experts``'s
#: ``dispatch`` argument; ``PlannerOptions.token_dispatch``): the planner picks ("auto"),
#: torchtitan's all-to-all, or every token to every device of the experts' mesh dim.
DISPATCHES = ("auto", "all_to_all", "all_gather")

#: Which stage-mesh dims the routed experts are split over (``PlannerOptions.expert_dims``):
#: the planner picks ("auto", not splitting them included), or exactly these dims (an
#: expert-parallel group of their devices, as torchtitan's ``ep`` mesh dim).
EXPERT_DIMS = ("auto", "dp", "tp", "dp*tp")
