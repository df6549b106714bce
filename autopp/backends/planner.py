"""``Planner``: autopp's sharding planner chooses each stage's placements (``"auto"``).

Planning (:mod:`autopp.pipeline_plan`, :mod:`autopp.auto_plan`): rank 0 of the world plans
the whole pipeline (or reads it from the on-disk cache) into one
:class:`~autopp.pipeline_plan.PipelinePlan` and broadcasts it; every stage is planned over its
sub-mesh from one dp-global microbatch, with the activations' placements between stages and
the loss placement chosen by the same cost model. ``Planner(plan=...)`` runs a saved plan
instead, without planning. Running (:mod:`autopp.auto_stage`): each planned stage is
lowered to local graphs with explicit collectives and run as an
:class:`autopp.graph.GraphStage` on torch's action runtime (parameters gathered once per
step at UNSHARD, weight gradients at W, gradients reduced once at REDUCE_GRAD).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autopp.graph.recompute import Recompute
    from autopp.pipeline_plan import PipelinePlan

from autopp.backends.base import LossFn, PipelineSpec, StageBackend


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """What the planner may choose and under which assumptions.

    Attributes:
        profile: the device profile of the cost model ("H100", "H200", "A100", "CPU");
            None: "CPU" on a cpu mesh, else "H100".
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
        reshard_after_forward: True: a stage drops its gathered weights after each forward
            and gathers them again for the backward (FSDP's reshard-after-forward: 2 gathers
            per weight per microbatch) instead of gathering once per step and keeping the
            copy (False, the default). Correct (tested against single process), but it does
            not lower the measured peak yet (``benchmarks/memory.py``: higher at 8
            microbatches), so the planner does not choose it by itself.
        recompute: activation recomputation in the planned stages' lowered graphs
            (:mod:`autopp.graph.recompute`): "auto" (default: per stage, the fastest of the
            modes below whose plan fits the memory budget; "none" when it fits), "none" (the
            backward reads what the forward saved), "selective" (save matmul and attention
            outputs, recompute the cheap ops in the backward) or "full" (save only the stage
            input, recompute the rest in the backward). Reductions are always saved, never
            re-run; all-gathers of activations are gathered again in the backward. It works
            under every schedule, the I/W split included (I recomputes; W gets what it needs
            from I). The planner prices the recomputed forward.
    """

    profile: str | None = None
    memory_budget_bytes: float | None = None
    memory_reserve: float = 0.1
    parameter_budget_bytes: float | None = None
    boundary: Literal["auto", "batch", "batch+seq"] = "auto"
    loss_parallel: bool | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool = False
    recompute: Recompute | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.recompute not in ("auto", "none"):  # autopp.graph loads on first use only
            from autopp.graph.recompute import RECOMPUTE_POLICIES

            if self.recompute not in RECOMPUTE_POLICIES:
                raise ValueError(f"recompute must be one of 'auto', "
                                 f"{', '.join(map(repr, RECOMPUTE_POLICIES))}, "
                                 f"got {self.recompute!r}")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """Inductor compilation of the planned stages' graphs (``compile=``).

    Attributes:
        bucket_collectives: let Inductor bucket the graphs' all-gathers, reduce-scatters and
            all-reduces (fewer, larger messages).
        reorder_for_overlap: let Inductor reorder collectives to overlap them with compute.
    Both are off by default: on CPU (gloo) collectives are synchronous, so neither helps.
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


@dataclass
class Planner(StageBackend):
    """autopp's planner (``parallelize="auto"``); see the module docstring.

    Args:
        options: what the planner may choose (:class:`PlannerOptions`).
        compile: run each planned stage's graphs through Inductor: True, or
            :class:`CompileOptions` for its collective passes; False (default): eager.
        plan: a :class:`~autopp.pipeline_plan.PipelinePlan` (or the path of a saved one) to
            run instead of planning: checked against the pipeline (model, mesh, schedule,
            microbatches, inputs, split, loss) at ``prepare``; its planning options are the
            plan's (a differing one set in ``options`` is an error).
    """

    options: PlannerOptions = field(default_factory=PlannerOptions)
    compile: bool | CompileOptions = False
    plan: PipelinePlan | str | os.PathLike | None = None
    #: Where the pipeline plan came from: "given" (``plan=``), "planned" or "cached" (on
    #: this rank, rank 0 of the world), "from rank 0" (broadcast); "" before ``prepare``.
    plan_source: str = field(default="", init=False)
    _pipeline_plan: Any = field(default=None, init=False, repr=False)
    _planned: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _last_stage: int = field(default=-1, init=False, repr=False)
    _regather: dict[int, tuple[bool, str]] = field(default_factory=dict, init=False, repr=False)

    name = "planner"
    uses_graph_runtime = True
    grads_summed_over_dp = True

    def __post_init__(self) -> None:
        if self.plan is not None:
            from autopp.pipeline_plan import as_pipeline_plan

            self.plan = as_pipeline_plan(self.plan)
            conflicts = self.plan.options.conflicts(self.options)
            if self.options.recompute not in ("none", "auto") and set(self.plan.recompute) != {
                    self.options.recompute}:
                conflicts.append(f"recompute: the plan has {sorted(set(self.plan.recompute))}, "
                                 f"the options {self.options.recompute!r}")
            if conflicts:
                raise ValueError(
                    "the saved plan was made with other planner options: "
                    + "; ".join(conflicts) + ". Leave them out (the plan's apply), or plan "
                    "again with them (drop plan=)")

    def prepare(self, spec: PipelineSpec) -> None:
        from autopp.auto_plan import planned_stages
        from autopp.mesh import mesh_sizes

        self._last_stage = len(spec.fqns_per_stage) - 1
        if self.plan is not None:
            sizes = mesh_sizes(spec.mesh)
            self.plan.check(
                model=spec.model, pp=sizes["pp"], dp=sizes["dp"], tp=sizes["tp"],
                schedule=spec.schedule, n_microbatches=spec.n_microbatches,
                example_inputs=spec.example_inputs, fqns_per_stage=spec.fqns_per_stage,
                stage_ranks=spec.rank_of, loss_fn=spec.loss_fn)
            self._pipeline_plan, self.plan_source = self.plan, "given"
        else:
            from autopp.pipeline_plan import plan_for_spec

            self._pipeline_plan, self.plan_source = plan_for_spec(spec, self.options)
        self._planned = planned_stages(self._pipeline_plan, spec)

    def build(self, stage_id: int, stage_meta: nn.Module, sub_mesh: DeviceMesh) -> nn.Module:
        return stage_meta

    def materialize(self, stage_id: int, module: nn.Module, sub_mesh: DeviceMesh, *,
                    seed: int, device: torch.device) -> nn.Module:
        from autopp.auto_stage import materialize_and_apply

        planned = self._planned[stage_id]
        return materialize_and_apply(module, planned.plan, sub_mesh, planned.example_inputs,
                                     seed=seed, device=device,
                                     recompute=self._pipeline_plan.recompute[stage_id])

    def named_parameters(self, modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
        return [kv for m in modules for kv in m.named_planned_parameters()]

    def named_buffers(self, modules: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
        return [kv for m in modules for kv in m.named_planned_buffers()]

    def pipeline_stage(self, stage_id: int, module: nn.Module, *, n_stages: int,
                       device: torch.device, pp_group: dist.ProcessGroup, loss_fn: LossFn,
                       get_mesh: Callable[..., DeviceMesh]) -> Any:
        from autopp.auto_stage import planned_graph_stage

        regather, why = self._choose_regather(module)
        self._regather[stage_id] = (regather, why)
        return planned_graph_stage(module, stage_index=stage_id, num_stages=n_stages,
                                   device=device, group=pp_group, loss_fn=loss_fn,
                                   compile=self.compile, regather_for_backward=regather)

    def _choose_regather(self, module: nn.Module) -> tuple[bool, str]:
        """Keep the gathered weights for the step, or re-gather them for every forward and
        backward (``PlannerOptions.reshard_after_forward``); and what that means here."""
        gathered = module.gathered_param_bytes()
        if gathered == 0:
            return False, "no weight is gathered"
        params = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
        mib = 2**20
        if self.options.reshard_after_forward:
            return True, (f"asked for (reshard_after_forward=True); the {gathered / mib:.2f} "
                          "MiB gathered copy lives only during one forward or backward")
        return False, (f"{params / mib:.2f} MiB of parameter shards plus this copy "
                       "(reshard_after_forward=True would re-gather for every forward and "
                       "backward instead)")

    def vocab_parallel_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        last = self._planned.get(self._last_stage)
        return mesh["dp", "tp"] if last is not None and last.boundary_out == "vocab" else None

    def describe(self, stage_id: int, module: nn.Module | None) -> list[str]:
        planned = self._planned.get(stage_id)
        if planned is None:
            return []
        report = str(planned.plan).split("\n\n")[0].splitlines()  # the summary lines
        out = [f"  stage {stage_id} plan: " + "\n    ".join(report)]
        if module is not None and hasattr(module, "stage_graphs"):  # lowered after init
            from autopp.sharding.memory import gathered_values_per_param

            kept = module.saved_bytes_per_microbatch()
            gathered = module.gathered_param_bytes()
            recompute = ("" if module.recompute == "none"
                         else f"; recompute={module.recompute!r}: the backward recomputes the rest")
            out.append(f"    keeps {kept / 2**20:.2f} MiB per microbatch per device for the "
                       f"backward (activations{recompute})")
            regather, why = self._regather.get(stage_id, (False, ""))
            if regather:
                out.append(f"    re-gathers its weights for every microbatch's forward and "
                           f"backward (reshard after forward; 2 gathers per weight per "
                           f"microbatch): {why}")
            elif gathered:
                out.append(f"    keeps {gathered / 2**20:.2f} MiB of weights gathered once per "
                           f"step (UNSHARD to RESHARD): {why}")
            local, graphs = module.stage_graphs()
            per_param = gathered_values_per_param(graphs, local.param_fqns)
            twice = sorted(f for f, n in per_param.items() if n > 1)
            if per_param:
                when = "for every forward and backward" if regather else "once per step"
                out.append(f"    gathers {len(per_param)} weights {when}"
                           + (f"; {len(twice)} of them in two or more placements (the plan "
                              f"uses them in differently sharded layouts, each gathered once): "
                              f"{', '.join(twice[:4])}{' ...' if len(twice) > 4 else ''}"
                              if twice else ""))
        if planned.send_bytes:
            how = ("batch split over dp, sequence over tp)" if planned.boundary_out == "batch+seq"
                   else "batch split over dp, whole over tp)")
            out.append(f"    sends {planned.send_bytes / 2**10:.1f} KiB per microbatch per "
                       f"device to stage {stage_id + 1} (boundary {planned.boundary_out}: {how}")
        return out

    @property
    def plans(self) -> dict[int, Any]:
        return {s: p.plan for s, p in self._planned.items()}

    @property
    def pipeline_plan(self) -> PipelinePlan | None:
        """The whole pipeline's plan this backend runs (None before ``prepare``): save it
        (``.save(path)``) to run it again with ``plan=`` without planning."""
        return self._pipeline_plan
