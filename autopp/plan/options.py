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
    """What the planner may choose and under which assumptions.

    Attributes:
        profile: the device profile of the cost model ("H100", "H200", "A100",
            "A100-40GB", "CPU", "measure", or a registered name); None: the detected
            device's ("CPU" on a cpu mesh; a CUDA device by its name and memory, an unknown
            GPU is an error asking for ``profile=``).
        memory_budget_bytes: per-device memory the plan must fit: parameters, gradients,
            AdamW state, gathered parameters, and the activations of every microbatch in
            flight on the stage under the schedule (the schedule simulator's count); shared
            equally by a rank's stages. None: the profile's device memory less
            ``memory_reserve``.
        memory_reserve: the share of the device's memory left out of the default budget
            (allocator fragmentation, communication buffers, the loss): 0.1.
        parameter_budget_bytes: instead of the whole-memory budget, a per-device bound on
            the parameters' own bytes alone (no gradients, optimizer state, gathered copies
            or activations): a ZeRO-3 / FSDP-style storage cap that makes the planner shard
            weights over dp and gather them once per step at UNSHARD. Not with
            ``memory_budget_bytes``; None (default): the whole-memory budget.
        boundary: placement of activations sent between stages: "auto" (chosen by cost:
            stage times plus transfer time), "batch" (batch split over dp, whole over tp) or
            "batch+seq" (sequence also split over tp: 1/tp of the bytes).
        loss_parallel: with ``loss_fn=autopp.cross_entropy``, whether the last stage keeps
            its logits split on the vocabulary over tp and computes the loss in parallel:
            None (chosen by cost), True (always) or False (never).
        mixed_precision: torch's FSDP2 ``MixedPrecisionPolicy``, e.g. bf16 compute with
            parameters gathered in bf16 and gradients reduced in fp32 into fp32 masters.
        weight_gathering: how planned stages hold their dp-sharded weights and gradients
            (:mod:`autopp.graph.weight_gathering`): "once_per_step" (default: gathered once
            at UNSHARD and kept all step, gradients summed unreduced and reduced once) or
            "per_block" (FSDP's: each block gathered for its forward and again for its
            backward, its gradients reduce-scattered as they are made, every microbatch).
        prefetch_blocks: with "per_block", how many blocks ahead a block's gathers are
            issued (default 1).
        reshard_after_forward: retired; ``weight_gathering="per_block"`` replaces it.
        recompute: activation recomputation in the planned stages' lowered graphs
            (:mod:`autopp.graph.recompute`): "auto" (default: per stage, the fastest of the
            modes below whose plan fits the memory budget; "none" when it fits), "none" (the
            backward reads what the forward saved), "selective" (save matmul and attention
            outputs, recompute the cheap ops in the backward) or "full" (save only the stage
            input, recompute the rest in the backward). Reductions are always saved, never
            re-run; all-gathers of activations are gathered again in the backward. It works
            under every schedule, the I/W split included (I recomputes; W gets what it needs
            from I). The planner prices the recomputed forward.
        token_dispatch: mixture-of-experts layers (torchtitan's ``MoE``): how tokens reach
            the devices holding their experts: "auto" (the planner prices every way and
            picks), "all_to_all" (torchtitan's expert parallel: each token sent only where
            its experts are) or "all_gather" (every device of the experts' mesh dim gets
            every token). Default: the process default, "auto" unless
            ``autopp.adapters.torchtitan_moe.set_token_dispatch`` changed it.
        expert_compute_dtype: mixture-of-experts layers: the dtype routed experts compute in:
            "bfloat16" (what torchtitan's ``GroupedExperts`` does, whatever the parameters'
            dtype), "float16", "float32", or "param" (the parameters' own dtype: fp32
            numerics to compare with an fp32 reference). Default: the process default,
            "bfloat16" unless ``set_expert_compute_dtype`` changed it.
        overlap_collectives: reorder each planned stage's lowered graphs (forward, backward
            pieces, unshard, reduce-grad) so that every collective is issued as soon as its
            inputs exist and waited just before its result is first used
            (:mod:`autopp.graph.overlap`): communication can then run under compute where
            collectives are asynchronous (NCCL). On by default; the values are the same
            either way. The estimates and the simulator price what it hides; the planner
            prices a piece's collectives in full, and with it on (weights gathered once per
            step) UNSHARD's and REDUCE_GRAD's by the windows the schedule leaves them
            (:mod:`autopp.sharding.once_per_step`).
        tf32: price fp32 matmuls at the profile's TF32 tensor-core rate (``flops_tf32``)
            rather than true fp32's (``flops_fp32``). Default: whether torch uses TF32 in
            this process when the options are made
            (``torch.get_float32_matmul_precision()`` "high" or "medium", or
            ``torch.backends.cuda.matmul.allow_tf32``;
            :func:`autopp.profiles.devices.tf32_enabled`). The plan records it (and the plan
            cache keys hold it): set torch's precision before making the options.
        strict: refuse a plan that a fallback changed (an op replicated because DTensor's
            sharding rule failed or has no option for it, an op priced without FLOPs because
            its formula failed): raise on every rank, listing them. False (default): each is
            logged as a warning once and listed in the plan's ``describe()``. Not part of
            the plan (it changes no choice), so a cached or saved plan is checked too.

    The plan records ``token_dispatch`` and ``expert_compute_dtype`` (they change what is traced); every later trace of its
    stages (applying it, estimating it) uses the plan's values, not the process default.
    """

    profile: str | None = None
    memory_budget_bytes: float | None = None
    memory_reserve: float = 0.1
    parameter_budget_bytes: float | None = None
    boundary: Literal["auto", "batch", "batch+seq"] = "auto"
    loss_parallel: bool | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    weight_gathering: Literal["once_per_step", "per_block"] = "once_per_step"
    prefetch_blocks: int = 1
    reshard_after_forward: bool | None = None
    recompute: Recompute | Literal["auto"] = "auto"
    token_dispatch: str = field(default_factory=lambda: tracing.setting("token_dispatch"))
    expert_compute_dtype: str = field(
        default_factory=lambda: tracing.setting("expert_compute_dtype"))
    overlap_collectives: bool = True
    tf32: bool = field(default_factory=tf32_enabled)
    strict: bool = False

    def trace_settings(self) -> dict[str, str]:
        """The options that change what is traced, as :func:`autopp.tracing.settings`
        takes them."""
        return {"token_dispatch": self.token_dispatch,
                "expert_compute_dtype": self.expert_compute_dtype}

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
        if self.weight_gathering not in ("once_per_step", "per_block"):
            raise ValueError(f"weight_gathering must be 'once_per_step' or 'per_block', got "
                             f"{self.weight_gathering!r}")
        if not (isinstance(self.prefetch_blocks, int) and self.prefetch_blocks >= 0):
            raise ValueError(f"prefetch_blocks is a number of blocks >= 0, got "
                             f"{self.prefetch_blocks!r}")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"memory_reserve is a share of the device memory in [0, 1), "
                             f"got {self.memory_reserve}")
        if self.boundary not in ("auto", "batch", "batch+seq"):
            raise ValueError(f"boundary must be 'auto', 'batch' or 'batch+seq', got {self.boundary!r}")
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
