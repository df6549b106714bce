"""autopp's sharding planner: automatic DP×TP sharding of one pipeline stage on its sub-mesh.

Public API::

    plan = plan_stage(stage_on_meta, (x_meta,), sub_mesh, profile="H100",
                      memory_budget_bytes=..., time_limit_s=60)
    print(plan); plan.save("plan.json"); StagePlan.load("plan.json")
    ours, theirs = compare_with_torchtitan(stage_on_meta, (x_meta,), sub_mesh)  # same costs
    sharded = apply_plan(materialised_stage, plan, sub_mesh, (x_meta,))  # DTensor params
    y = sharded(x)  # x global (or a DTensor); y a DTensor in plan.output_placements

Design notes (to fold into docs/design.md)
------------------------------------------
Data path, one module per step:

- ``trace.py``: AOTAutograd's ``aot_export_joint_with_descriptors`` gives the functional joint
  forward+backward aten graph on meta tensors with global shapes; descriptors tie each
  gradient output to its parameter (and tangents to outputs, input grads to inputs).
- ``strategies.py``: candidate options per node from DTensor's own registry
  (``op_strategy_funcs`` and single-dim rules expanded to the mesh), queried on a (fake)
  DeviceMesh with the producers' options as multi-option input strategies. Single-dim rules
  get one option per input (they enumerate all combinations themselves); single-input rules
  (views) are asked once per producer placement. DTensor's own redistribute-cost estimates
  are switched off during enumeration (the ``_StridedShard`` graph search trap of facts.md);
  ``_StridedShard`` and uneven options are pruned (batch stays on dp ahead of tp, so
  sequence-parallel layouts flatten to plain ``Shard``). No rule -> DTensor's decomposition
  tracing as the next resort -> else replicated and listed in the plan's fallbacks.
  SDPA on meta decomposes to matmul/softmax, so attention never depends on the tracing
  device's kernel.
- ``costs.py`` + ``profiles.py``: roofline compute (torch's FLOP registry, bytes vs memory
  bandwidth) and α-β collectives per mesh dim (intra- vs inter-node from the mesh layout);
  profiles H100, H200, A100, CPU chosen by name, never by querying the device.
- ``solver.py``: ILP (written out in its docstring) with binary node choices and continuous
  edge flows; HiGHS solves the LP relaxation first (integral in practice) and only branches
  if it is not. Costs are scaled to microseconds for the solver's tolerances. Follower edges
  (single-input ops) only carry the producer's own placement (or, where the follower has no
  option for it, e.g. a pruned ``_StridedShard`` view, any placement it accepts), which
  removes most flow variables. Boundary constraints only change column bounds, so a block's
  model is built once for all its boundary pairs.
- ``chain.py``: a stage is split into units (torchtitan decoder order: ``tok_embeddings``,
  each of ``layers``, ``norm``+``lm_head``; any other module is one flat unit). Identical
  units (structural signature) are traced once, their ILP built once and solved once per
  boundary pair (batch on dp; replicated or sequence-sharded on tp; only pairs a chain can
  use), then the boundaries are chosen along the chain by DP.
- ``plan.py`` / ``report.py``: the plan is a frozen dataclass with JSON round trip and a
  printed report (parameter placements, collectives with bytes and time, step time, memory,
  fallbacks).
- ``apply.py`` (first version): parameters/buffers become DTensors with the planned
  placements; each block's joint graph runs node by node on DTensors, arguments redistributed
  to the planned placements (DTensor performs the collectives; planned ``Partial`` values are
  left as DTensor holds them), gradients leave in their parameter's placement. Forward runs
  the forward nodes only; backward re-runs the joint graph with the tangent (recompute).
  Fused kernels the runtime backend lacks (``_fused_rms_norm_backward`` on CPU) run through
  torch's decomposition. Next version: a local graph with explicit collectives.
- ``torchtitan_ref.py``: torchtitan's FSDP+TP placements for llama3 blocks evaluated under the
  same cost model (activation placements re-optimised with parameters fixed), so both
  estimates are comparable.
- ``_torch_private.py``: the only module importing private torch APIs.

Measured (2-core CPU machine, shared): 8 llama3-8B blocks (dim 4096, seq 2048, batch 32) on
a fake 32×8 mesh with a parameter-memory budget plan in 12-15 s median (one 66k-variable
model, 4 boundary solves; with the budget row the LP relaxation is no longer integral and
HiGHS branches, which is most of the time). On 2×4, 8×8 and 32×8 the planned estimate was
not above torchtitan's FSDP+TP layout priced by the same model
(``benchmarks/plan_time.py --compare``; tests/sharding/test_torchtitan_ref.py).

Known limits: the cost model counts the joint graph as traced (no re-gather of FSDP
parameters in backward, no activation memory, no overlap of communication with compute);
the memory budget covers parameters (× a state factor) only; only a block-stack stage
(``module.layers``, with a decoder's embedding/head) gets block reuse, other stages are
planned as one flat graph; apply is the DTensor-executed first version (recompute in
backward, no bf16 policy, weights must be materialised before ``apply_plan`` rather than
initialised shard by shard).
"""

from autopp.sharding.apply import apply_plan
from autopp.sharding.plan import StagePlan
from autopp.sharding.planner import plan_stage
from autopp.sharding.profiles import PROFILES, DeviceProfile, get_profile
from autopp.sharding.solver import InfeasiblePlanError
from autopp.sharding.torchtitan_ref import compare_with_torchtitan

__all__ = [
    "PROFILES",
    "apply_plan",
    "compare_with_torchtitan",
    "DeviceProfile",
    "InfeasiblePlanError",
    "StagePlan",
    "get_profile",
    "plan_stage",
]
