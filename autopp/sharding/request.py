"""What :func:`~autopp.sharding.plan_stage` is asked: one frozen value per stage plan.

A :class:`StageRequest` holds everything a stage's plan depends on (the module and its
inputs, the mesh, the boundary pair, the memory spec, the precision, the keyword inputs, the
solver's options), with the device profile resolved once; :meth:`StageRequest.key` is its
plan cache key, the one place that key is made. :class:`StageMemory` is the memory spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from autopp.profiles.devices import DeviceProfile

RecomputeChoice = Literal["none", "selective", "full", "auto"]
WeightGatheringChoice = Literal["once_per_step", "per_block"]
DEFAULT = "default"
"""A boundary placement: the batch ``S(0)`` on dp, ``R`` elsewhere."""


def check_gap(gap: float | None) -> None:
    """Refuse an optimality gap outside (0, 1) (None: the default)."""
    if gap is not None and not (isinstance(gap, (int, float)) and 0 < gap < 1):
        raise ValueError(f"optimality_gap is a fraction of the stage's time in (0, 1), e.g. "
                         f"0.01 (within 1% of the best possible) or 0.1 (faster planning), "
                         f"got {gap!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """What a stage's memory row counts and what bounds it
    (:mod:`autopp.sharding.ilp.memory_row`)."""

    budget_bytes: float | None = None
    """Per-device bound on what the row counts; None: no bound (memory still estimated)."""
    activation_factor: float | None = None
    """Microbatches in flight on the stage (1F1B: min(M, pp - stage index)): the row counts
    the state, the activations × this and the gathered parameters once. None: parameter
    bytes only (the parameter budget, ``PlannerOptions.parameter_budget_bytes``)."""
    split_in_flight: tuple[tuple[float, float], ...] = ()
    """With a split backward, (microbatches between F and I, between I and W) at each peak
    (:func:`autopp.schedules.in_flight.split_in_flight`); needs ``activation_factor``."""
    optimizer_state_factor: float | None = None
    """Optimizer state bytes per parameter byte, sharded like it (AdamW, fp32: 2.0), counted
    with the parameters and their gradients; None: parameters alone."""
    largest_tensor_bytes: float | None = None
    """No tensor made and freed within an action may be larger (where none remains, the
    bound is dropped and the notes say so); None: no bound."""
    recompute: RecomputeChoice = "none"
    """"none", "selective", "full", or "auto" (the fastest that fits the budget)."""
    price: float = 0.0
    """Plan for time + this many seconds per counted byte instead of under a budget
    (``inf``: the least-memory plan); one recompute mode, no budget."""
    weight_gathering: WeightGatheringChoice = "once_per_step"
    """How gathered weights are held (:mod:`autopp.graph.weight_gathering`)."""
    prefetch_blocks: int = 1
    """Per block: units whose gathered weights are prefetched beside the running one."""

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "selective", "full", "auto"):
            raise ValueError(f"recompute must be one of ('none', 'selective', 'full', 'auto'),"
                             f" got {self.recompute!r}")
        if self.weight_gathering not in ("once_per_step", "per_block"):
            raise ValueError(f"weight_gathering must be 'once_per_step' or 'per_block', got "
                             f"{self.weight_gathering!r}")
        if self.split_in_flight and self.activation_factor is None:
            raise ValueError("split_in_flight counts activations: pass activation_factor too")
        if self.price and (self.recompute == "auto" or self.budget_bytes is not None):
            raise ValueError("memory_price plans one recompute mode without a budget")
        object.__setattr__(self, "split_in_flight",
                           tuple((float(a), float(b)) for a, b in self.split_in_flight))


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRequest:
    """One stage to plan on its (sub-)mesh, and how; see :func:`~autopp.sharding.plan_stage`."""

    module: nn.Module
    """The stage, on the meta device."""
    example_inputs: tuple[Any, ...]
    """Meta tensors with global shapes (and e.g. ``None`` masks)."""
    mesh: Any
    """A DeviceMesh with named dims (``("dp", "tp")``); fake process groups work."""
    profile: DeviceProfile | str = "H100"
    """The device profile (a name is resolved once, on construction)."""
    input_placements: Any = DEFAULT
    """Boundary in: "default", None (free) or one placement per mesh dim (None = any)."""
    output_placements: Any = DEFAULT
    """Boundary out, as ``input_placements``."""
    param_placements: Mapping[str, Any] = field(default_factory=dict)
    """FQN -> placement per mesh dim, for parameters whose placement is fixed."""
    memory: StageMemory = StageMemory()
    """What the memory row counts and what bounds it."""
    mixed_precision: Any = None
    """torch's FSDP2 ``MixedPrecisionPolicy`` (:mod:`autopp.tracing.precision`); None: the
    parameters' own dtype."""
    tf32: bool | None = None
    """fp32 matmuls at the profile's TF32 rate; None: as torch is set on construction."""
    keyword_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Keyword inputs every microbatch takes (name -> meta tensor, batch on dim 0), as graph
    inputs of every unit placed as the batch is; planned unit by unit only."""
    microbatches_per_grad_reduce: int = 1
    """The pipeline's microbatches per step (gradients reduced once a step)."""
    comm_windows_s: tuple[float, float] = (0.0, 0.0)
    """Seconds a step the once-per-step gathers and reductions may run beside compute
    (:mod:`autopp.sharding.chain.once_per_step`); zero: paid in full."""
    time_limit_s: float = 60.0
    """Per ILP."""
    optimality_gap: float | None = None
    """A memory-bound plan is kept once its time is proven within this fraction of the best
    possible (``PlannerOptions.optimality_gap``); None: the planner's default, 1%."""
    reuse_blocks: bool = True
    """Plan repeated blocks unit by unit, identical ones once (:mod:`autopp.tracing.units`)."""

    def __post_init__(self) -> None:
        from autopp.profiles.devices import tf32_enabled
        from autopp.profiles.lookup import get_profile

        set_ = object.__setattr__
        set_(self, "profile", get_profile(self.profile))
        set_(self, "tf32", tf32_enabled() if self.tf32 is None else bool(self.tf32))
        set_(self, "example_inputs", tuple(self.example_inputs))
        set_(self, "param_placements", dict(self.param_placements or {}))
        set_(self, "keyword_inputs", dict(self.keyword_inputs or {}))
        set_(self, "comm_windows_s", (float(self.comm_windows_s[0]),
                                      float(self.comm_windows_s[1])))
        check_gap(self.optimality_gap)

    def key(self) -> str:
        """The plan cache key: everything the plan depends on (the module by its structure
        and forward code, the profile by its numbers; :mod:`autopp.sharding.cache_key`)."""
        from autopp.sharding.cache_key import plan_key
        from autopp.sharding.plan import describe_keyword_inputs

        options = dict(
            profile=self.profile, boundary=(self.input_placements, self.output_placements),
            param_placements=sorted(self.param_placements.items()),
            memory=dataclasses.asdict(self.memory), mixed_precision=self.mixed_precision,
            tf32=self.tf32, keyword_inputs=describe_keyword_inputs(self.keyword_inputs),
            microbatches_per_grad_reduce=self.microbatches_per_grad_reduce,
            comm_windows_s=self.comm_windows_s, time_limit_s=self.time_limit_s,
            reuse_blocks=self.reuse_blocks, optimality_gap=self.optimality_gap)
        return plan_key(self.module, self.example_inputs, tuple(self.mesh.shape),
                        tuple(self.mesh.mesh_dim_names or ()), options)

    def replace(self, **changes: Any) -> StageRequest:
        """This request with ``changes`` (fields; ``memory`` fields by their own names)."""
        mem = {k: changes.pop(k) for k in list(changes) if k in _MEMORY_FIELDS}
        if mem:
            changes["memory"] = dataclasses.replace(changes.get("memory", self.memory), **mem)
        return dataclasses.replace(self, **changes)


_MEMORY_FIELDS = frozenset(f.name for f in dataclasses.fields(StageMemory))
