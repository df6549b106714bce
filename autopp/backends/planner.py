"""``Planner``: autopp's sharding planner chooses each stage's placements (``"auto"``).

Planning (:mod:`autopp.plan.value`, :mod:`autopp.plan.make`): rank 0 of the world plans
the whole pipeline (or reads it from the on-disk cache) into one
:class:`~autopp.plan.value.PipelinePlan` and broadcasts it; every stage is planned over its
sub-mesh from one dp-global microbatch, with the activations' placements between stages and
the loss placement chosen by the same cost model. ``Planner(plan=...)`` runs a saved plan
instead, without planning. Running (:mod:`autopp.lower.stage`): each planned stage is
lowered to local graphs with explicit collectives and run as an
:class:`autopp.graph.GraphStage` on torch's action runtime (parameters gathered once per
step at UNSHARD, weight gradients at W, gradients reduced once at REDUCE_GRAD).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:

    from autopp.plan.value import PipelinePlan

from autopp.backends.base import LossFn, PipelineSpec, StageBackend
from autopp.plan.options import CompileOptions, PlannerOptions, resolve_compile
from autopp.plan.rank0 import plan_on_rank0


@dataclass
class Planner(StageBackend):
    """autopp's planner (``parallelize="auto"``); see the module docstring.

    Args:
        options: what the planner may choose (:class:`PlannerOptions`).
        compile: run each planned stage's graphs through Inductor: True (on a CUDA mesh
            with Inductor's collective bucketing and compute/communication reordering on,
            :meth:`CompileOptions.for_device`), or :class:`CompileOptions` for its
            collective passes as given; False (default): eager.
        plan: a :class:`~autopp.plan.value.PipelinePlan` (or the path of a saved one) to
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

    name = "planner"
    grads_summed_over_dp = True
    takes_built_keyword_inputs = True
    stats_reduced_over_dp = True  # the planned graphs reduce them

    def __post_init__(self) -> None:
        if self.plan is not None:
            from autopp.plan.value import as_pipeline_plan

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
        from autopp.plan.make import planned_stages
        from autopp.mesh import mesh_sizes

        self._last_stage = len(spec.fqns_per_stage) - 1
        if self.plan is not None:
            sizes = mesh_sizes(spec.mesh)
            self.plan.check(
                model=spec.model, pp=sizes["pp"], dp=sizes["dp"], tp=sizes["tp"],
                schedule=spec.schedule, n_microbatches=spec.n_microbatches,
                example_inputs=spec.example_inputs, fqns_per_stage=spec.fqns_per_stage,
                stage_ranks=spec.rank_of, loss_fn=spec.loss_fn,
                keyword_inputs=dict(spec.keyword_inputs))
            if self.options.strict:  # every rank holds the given plan: all raise together
                self.plan.check_strict()
            self._pipeline_plan, self.plan_source = self.plan, "given"
        else:
            from autopp.backends.planner import plan_for_spec

            self._pipeline_plan, self.plan_source = plan_for_spec(spec, self.options)
        self._planned = planned_stages(self._pipeline_plan, spec)

    def build(self, stage_id: int, stage_meta: nn.Module, sub_mesh: DeviceMesh) -> nn.Module:
        return stage_meta

    def materialize(self, stage_id: int, module: nn.Module, sub_mesh: DeviceMesh, *,
                    seed: int, device: torch.device) -> nn.Module:
        from autopp.lower.apply import PlanMismatchError
        from autopp.lower.stage import materialize_and_apply

        planned = self._planned[stage_id]
        try:
            return materialize_and_apply(module, planned.plan, sub_mesh,
                                         planned.example_inputs, seed=seed, device=device,
                                         recompute=self._pipeline_plan.recompute[stage_id],
                                         overlap_collectives=self.options.overlap_collectives)
        except PlanMismatchError as e:
            raise PlanMismatchError(self._evicted(stage_id, e)) from e

    def _evicted(self, stage_id: int, err: Exception) -> str:
        """Evict the plan's cache entries after it failed to apply (the cache held a plan
        for another graph), and say so: the next run plans anew."""
        from autopp.plan.cache import cache_dir, evict

        plan = self._pipeline_plan
        if self.plan_source == "given" or not plan.cache_entries:
            return f"stage {stage_id}: {err}"
        removed = evict(plan.cache_entries, f"stage {stage_id} did not apply: {err}")
        return (f"stage {stage_id}: {err}. The plan came from the plan cache "
                f"({cache_dir()}, entry {plan.cache_entries[0]}); its {len(removed)} entries "
                "on this host were evicted, so running again plans anew")

    def build_schedule(self, schedule: str, stages: Sequence[Any], **kw: Any
                       ) -> tuple[Any, Any]:
        """Graph stages on torch's action-list schedule, driven by autopp.graph's runtime."""
        from autopp.graph import attach_graph_runtime
        from autopp.schedules import build_schedule

        built = build_schedule(schedule, stages, runtime=True, **kw)
        return built, attach_graph_runtime(built)

    def named_parameters(self, modules: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
        return [kv for m in modules for kv in m.named_planned_parameters()]

    def named_buffers(self, modules: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
        return [kv for m in modules for kv in m.named_planned_buffers()]

    def pipeline_stage(self, stage_id: int, module: nn.Module, *, n_stages: int,
                       device: torch.device, pp_group: dist.ProcessGroup, loss_fn: LossFn,
                       get_mesh: Callable[..., DeviceMesh]) -> Any:
        from autopp.graph.weight_gathering import WeightGathering
        from autopp.lower.stage import planned_graph_stage

        return planned_graph_stage(module, stage_index=stage_id, num_stages=n_stages,
                                   device=device, group=pp_group, loss_fn=loss_fn,
                                   compile=resolve_compile(self.compile, module.mesh.device_type),
                                   gathering=WeightGathering.of_stage(
                                       getattr(module, "plan", None),
                                       self.options.prefetch_blocks))

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
            from autopp.graph.weight_gathering import WeightGathering
            from autopp.lower.memory import gathered_values_per_param

            kept = module.saved_bytes_per_microbatch()
            gathered = module.gathered_param_bytes()
            recompute = ("" if module.recompute == "none"
                         else f"; recompute={module.recompute!r}: the backward recomputes the rest")
            out.append(f"    keeps {kept / 2**20:.2f} MiB per microbatch per device for the "
                       f"backward (activations{recompute})")
            policy = WeightGathering.of_stage(planned.plan, self.options.prefetch_blocks)
            params = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
            if gathered:
                out.append("    " + policy.describe(gathered, params))
            # weight_gathering="auto": which way this stage holds them, and why
            out += [f"    {n}" for n in planned.plan.notes if n.startswith("weights gathered")]
            local, graphs = module.stage_graphs()
            per_param = gathered_values_per_param(graphs, local.param_fqns)
            twice = sorted(f for f, n in per_param.items() if n > 1)
            if per_param:
                out.append(f"    gathers {len(per_param)} weights {policy.when}"
                           + (f"; {len(twice)} of them in two or more placements (the plan "
                              f"uses them in differently sharded layouts, each gathered once): "
                              f"{', '.join(twice[:4])}{' ...' if len(twice) > 4 else ''}"
                              if twice else ""))
            from autopp.graph.overlap import describe_overlap

            out.append("    " + describe_overlap(graphs, module.overlap_collectives,
                                                 compiled=bool(self.compile)))
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


def plan_for_spec(spec: PipelineSpec, options: PlannerOptions) -> tuple[PipelinePlan, str]:
    """The plan of ``spec``'s pipeline (a :class:`autopp.backends.PipelineSpec`), made on
    rank 0 and broadcast (:func:`plan_on_rank0`); what the planner backend runs."""
    from autopp.plan.make import PipelineRequest, plan_whole_pipeline
    from autopp.mesh import mesh_sizes

    return plan_on_rank0(lambda: plan_whole_pipeline(PipelineRequest(
        model=spec.model, pp=mesh_sizes(spec.mesh)["pp"], fqns_per_stage=spec.fqns_per_stage,
        stage_ranks=spec.rank_of, sub_mesh=spec.sub_mesh, schedule=spec.schedule,
        n_microbatches=spec.n_microbatches, example_inputs=spec.example_inputs,
        options=options, loss_fn=spec.loss_fn,
        stage_modules=tuple(spec.stage_modules or ()) or None,
        keyword_inputs=dict(spec.keyword_inputs))))
