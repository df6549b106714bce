"""What the planner may choose and under which limits: :class:`PlannerOptions` (profile,
memory budget and reserve, boundaries, loss parallel, recompute, mixed precision) and
:class:`CompileOptions` for planned stages. ``autopp.backends`` re-exports both."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from autopp import tracing
from autopp.profiles.devices import tf32_enabled


if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autopp.graph.recompute import Recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """What the planner may choose and under which limits; one value across the public entry
    points (``pipeline_autoparallel``, ``plan_pipeline``, ``dry_run``, ``search``).

    Frozen and keyword-only. Each field is documented where it is declared. The options that
    change what is traced (``token_dispatch``, ``expert_compute_dtype``) are recorded in the
    plan, and every later trace of its stages uses the plan's values, not the process default.
    """

    #: Device profile of the cost model ("H100", "H200", "A100", "A100-40GB", "CPU",
    #: "measure" or a registered name); None: the detected device's (an unknown GPU is
    #: an error asking for ``profile=``).
    profile: str | None = None
    #: Per-device memory the plan must fit (parameters, gradients, AdamW state,
    #: gathered parameters, activations of every microbatch in flight), shared equally
    #: by a rank's stages. None: the profile's memory less ``memory_reserve``.
    memory_budget_bytes: float | None = None
    #: Share of device memory left out of the default budget (fragmentation and
    #: what the accounting does not model).
    memory_reserve: float = 0.1
    #: Instead of the whole-memory budget, a bound on the parameters' own bytes
    #: (a ZeRO-3-style cap that makes the planner shard weights over dp). Not with
    #: ``memory_budget_bytes``.
    parameter_budget_bytes: float | None = None
    #: Placement of activations sent between stages: "auto" (by cost), "batch" (split
    #: over dp) or "batch+seq" (also split over tp: 1/tp of the bytes).
    boundary: Literal["auto", "batch", "batch+seq"] = "auto"
    #: With ``loss_fn=autopp.cross_entropy``: keep the logits split on the vocabulary
    #: over tp and compute the loss in parallel. None: chosen by cost.
    loss_parallel: bool | None = None
    #: torch's FSDP2 ``MixedPrecisionPolicy`` (e.g. bf16 compute, fp32 reduction).
    mixed_precision: MixedPrecisionPolicy | None = None
    #: How planned stages hold dp-sharded weights (:mod:`autopp.graph.weight_gathering`):
    #: "once_per_step" (gathered at UNSHARD, gradients reduced once), "per_block"
    #: (FSDP's: gathered per block in forward and backward, reduced every microbatch), or
    #: "auto": each stage once per step where that fits without recomputation, else the
    #: faster of the two that fit.
    weight_gathering: Literal["once_per_step", "per_block", "auto"] = "once_per_step"
    #: With "per_block": how many blocks ahead a block's gathers are issued.
    prefetch_blocks: int = 1
    #: Retired: raises, naming ``weight_gathering="per_block"``.
    reshard_after_forward: bool | None = None
    #: Activation recomputation (:mod:`autopp.graph.recompute`): "auto" (per stage the
    #: fastest mode that fits, "none" first), "none", "selective" or "full".
    recompute: Recompute | Literal["auto"] = "auto"
    #: MoE layers: how tokens reach their experts: "auto" (by price), "all_to_all"
    #: (torchtitan's expert parallel) or "all_gather". Default: the process default.
    token_dispatch: str = field(default_factory=lambda: tracing.setting("token_dispatch"))
    #: MoE layers: the stage-mesh dims the routed experts are split over: "auto" (the
    #: planner chooses, not splitting them included), "dp", "tp" or "dp*tp" (an
    #: expert-parallel group of those devices, as torchtitan's ``ep``; with
    #: ``token_dispatch="all_to_all"`` tokens are exchanged over exactly that group).
    expert_dims: str = "auto"
    #: MoE layers: the routed experts' compute dtype: "bfloat16" (torchtitan's),
    #: "float16", "float32" or "param" (the parameters' own). Default: the process default.
    expert_compute_dtype: str = field(
        default_factory=lambda: tracing.setting("expert_compute_dtype"))
    #: MoE layers: the busiest expert-parallel device's routed tokens over the mean. 1.0:
    #: routing assumed uniform over the experts (what the cost model prices by default);
    #: above 1 its expert compute and token exchange are priced at that many times the
    #: mean (one of ``autopp.adapters.torchtitan_moe.EXPERT_IMBALANCES``).
    expert_imbalance: float = 1.0
    #: Reorder planned graphs to issue collectives early and wait late
    #: (:mod:`autopp.graph.overlap`); values are the same either way.
    overlap_collectives: bool = True
    #: Price fp32 matmuls at the TF32 rate. Default: whether torch uses TF32 when the
    #: options are made (:func:`autopp.profiles.devices.tf32_enabled`); set torch's
    #: precision first. Recorded in the plan and its cache keys.
    tf32: bool = field(default_factory=tf32_enabled)
    #: How close to the best possible a memory-bound stage plan must be proven before the
    #: planner stops, e.g. 0.05: within 5% of a proven lower bound on the stage's time
    #: (the bound is in ``describe()``). None: 1%. Larger plans faster (fewer solves)
    #: and may give a slower plan.
    optimality_gap: float | None = None
    #: Refuse a plan a fallback changed (an op replicated for want of a rule, an op
    #: priced without FLOPs) on every rank. False: warn once and list it in
    #: ``describe()``. Not part of the plan, so cached and saved plans are checked too.
    strict: bool = False

    def trace_settings(self) -> dict[str, str]:
        """The options that change what is traced, as :func:`autopp.tracing.settings`
        takes them."""
        return {"token_dispatch": self.token_dispatch, "expert_dims": self.expert_dims,
                "expert_compute_dtype": self.expert_compute_dtype,
                "expert_imbalance": f"{float(self.expert_imbalance):g}"}

    def __post_init__(self) -> None:
        for name, value in self.trace_settings().items():
            tracing.check(name, value)
        if self.recompute not in ("auto", "none"):  # autopp.graph loads on first use only
            from autopp.graph.recompute import RECOMPUTE_POLICIES

            if self.recompute not in RECOMPUTE_POLICIES:
                raise ValueError(f"recompute must be one of 'auto', "
                                 f"{', '.join(map(repr, RECOMPUTE_POLICIES))}, "
                                 f"got {self.recompute!r}")
        if self.reshard_after_forward is not None:
            raise ValueError(
                "PlannerOptions(reshard_after_forward=...) is retired: use "
                "weight_gathering='per_block' (each block's weights gathered for its forward "
                "and again for its backward, its gradients reduce-scattered as they are "
                "made) or weight_gathering='once_per_step' (the default)")
        if self.weight_gathering not in ("once_per_step", "per_block", "auto"):
            raise ValueError(f"weight_gathering must be 'once_per_step', 'per_block' or "
                             f"'auto', got {self.weight_gathering!r}")
        if not (isinstance(self.prefetch_blocks, int) and self.prefetch_blocks >= 0):
            raise ValueError(f"prefetch_blocks is a number of blocks >= 0, got "
                             f"{self.prefetch_blocks!r}")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"memory_reserve is a share of the device memory in [0, 1), "
                             f"got {self.memory_reserve}")
        if self.boundary not in ("auto", "batch", "batch+seq"):
            raise ValueError(f"boundary must be 'auto', 'batch' or 'batch+seq', got {self.boundary!r}")
        if self.optimality_gap is not None:  # the planner loads on first use only
            from autopp.sharding.request import check_gap

            check_gap(self.optimality_gap)
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {self.memory_budget_bytes}")
        if self.parameter_budget_bytes is not None:
            if self.parameter_budget_bytes <= 0:
                raise ValueError(f"parameter_budget_bytes must be positive, got "
                                 f"{self.parameter_budget_bytes}")
            if self.memory_budget_bytes is not None:
                raise ValueError("set memory_budget_bytes (all memory) or "
                                 "parameter_budget_bytes (parameters alone), not both")


def changed_fields(options: PlannerOptions) -> list[str]:
    """The fields of ``options`` that differ from ``PlannerOptions()`` made now (sorted):
    what a caller chose, as against the defaults."""
    defaults = PlannerOptions()
    return sorted(f.name for f in dataclasses.fields(PlannerOptions)
                  if getattr(options, f.name) != getattr(defaults, f.name))


def refuse_loose(fn: str, keywords: Mapping[str, Any],
                 renamed: Mapping[str, str] | None = None) -> None:
    """Refuse the old spellings of an entry point's keywords, writing the new one.

    ``keywords`` are those ``fn`` did not take (its ``**``): a planner option given loose
    (the one way is ``options=PlannerOptions(...)``) or a keyword renamed across the entry
    points (``renamed``: old name -> new, e.g. ``global_batch_size`` -> ``global_batch``).
    The TypeError says what to write instead; any other name is refused as Python would.
    """
    if not keywords:
        return
    renamed = renamed or {}
    fields = {f.name for f in dataclasses.fields(PlannerOptions)}
    other = sorted(k for k in keywords if k not in fields and k not in renamed)
    if other:
        raise TypeError(f"{fn}() got unexpected keyword arguments {other}")
    fixes = [f"write {renamed[k]}={keywords[k]!r} instead of {k}={keywords[k]!r}"
             for k in sorted(keywords) if k in renamed]
    loose = sorted(k for k in keywords if k in fields and k not in renamed)
    if loose:
        given = ", ".join(f"{k}={keywords[k]!r}" for k in loose)
        fixes.append(f"the planner's options are one value: write "
                     f"options=PlannerOptions({given}) instead of {loose} "
                     f"(from autopp import PlannerOptions)")
    raise TypeError(f"{fn}(): " + "; ".join(fixes))


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """Inductor compilation of the planned stages' graphs (``compile=``).

    Attributes:
        bucket_collectives: let Inductor bucket the graphs' all-gathers, reduce-scatters and
            all-reduces (fewer, larger messages).
        reorder_for_overlap: let Inductor reorder collectives to overlap them with compute.
    Given explicitly, these are used as set (both False by default). ``compile=True``
    instead takes :meth:`for_device` of the stage's mesh: both on for a CUDA mesh (NCCL
    runs collectives asynchronously, so bucketing and reordering can hide them), both off
    on CPU (gloo's collectives gain nothing from them here).
    """

    bucket_collectives: bool = False
    reorder_for_overlap: bool = False

    def inductor_options(self) -> dict[str, Any]:
        """The Inductor config keys these options set (``torch.compile(options=...)``)."""
        opts: dict[str, Any] = {}
        if self.bucket_collectives:
            opts.update(bucket_all_gathers_fx="all", bucket_reduce_scatters_fx="all",
                        bucket_all_reduces_fx="all")
        if self.reorder_for_overlap:
            opts["reorder_for_compute_comm_overlap"] = True
        return opts

    @staticmethod
    def for_device(device_type: str) -> "CompileOptions":
        """What ``compile=True`` means on a mesh of ``device_type``: bucketing and
        reordering on for "cuda", off otherwise."""
        on = device_type == "cuda"
        return CompileOptions(bucket_collectives=on, reorder_for_overlap=on)


def resolve_compile(compile: "bool | CompileOptions", device_type: str
                    ) -> "bool | CompileOptions":
    """``compile=`` as a planned stage on a ``device_type`` mesh runs it: False stays
    False (eager), a :class:`CompileOptions` is used as given, True becomes
    :meth:`CompileOptions.for_device`."""
    if compile is True:
        return CompileOptions.for_device(device_type)
    return compile
