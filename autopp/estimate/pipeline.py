"""A planned pipeline's estimates, one way for every caller: each stage's plan → its
:class:`~autopp.schedules.StageCost` (:mod:`autopp.estimate.stage_costs`) → the schedule
simulator over the plan's own stage placement and pp link → the plan's
:class:`~autopp.plan.value.PipelineEstimates`. The dry run prices its stages with
:func:`stage_estimate` and simulates them with :func:`simulate_stages`; the torchtitan
integration calls :func:`estimate_plan` on the plan it trains with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from torch import nn

from autopp.estimate.stage_costs import (
    StageFacts,
    param_dtypes,
    pipeline_estimates,
    stage_cost,
    stage_facts,
    stage_facts_by_rule,
    state_bytes,
)
from autopp.graph.weight_gathering import WeightGathering
from autopp.plan.objective import pp_link, pp_links
from autopp.schedules import SimulationResult, StageCost, simulate_schedule
from autopp.schedules.memory_terms import communicator_bytes, module_buffer_bytes

#: How stage facts are found: "graphs" (lower every stage's plan to read its activation
#: memory and split its time into F / I / W), "rule" (F = I = W = a third of the plan's time,
#: no activation memory: cheaper, the peaks undercount).
EstimateMode = Literal["graphs", "rule"]


def stage_estimate(meta: nn.Module, plan: Any, sub_mesh: Any, inputs: tuple, n_microbatches: int,
                   *, mode: EstimateMode, loss_s: float, send_bytes: int,
                   gathering: WeightGathering = WeightGathering(),
                   memo: dict | None = None, overlap: bool = True
                   ) -> tuple[StageFacts, StageCost]:
    """One stage's facts and its simulator cost: ``meta`` the stage on meta, ``plan`` its
    :class:`~autopp.sharding.StagePlan`, ``inputs`` its dp-global microbatch inputs,
    ``gathering`` the pipeline's weight-gathering policy, ``overlap`` whether its graphs
    overlap communication with compute (``PlannerOptions.overlap_collectives``)."""
    if mode == "graphs":
        facts = stage_facts(meta, plan, sub_mesh, inputs, n_microbatches, memo=memo,
                            overlap=overlap)
    elif mode == "rule":
        facts = stage_facts_by_rule(plan, n_microbatches)
    else:
        raise ValueError(f"estimate mode {mode!r}: 'graphs' or 'rule'")
    return facts, stage_cost(facts, state_bytes(plan, param_dtypes(meta)), loss_s=loss_s,
                             p2p_bytes=send_bytes, gathering=gathering,
                             buffer_bytes=module_buffer_bytes(meta), collectives_ahead=overlap,
                             overlap=overlap)


def simulate_stages(schedule: str, costs: Sequence[StageCost], *, pp: int, n_microbatches: int,
                    stage_ranks: Sequence[int], profile: Any, mesh_shape: tuple[int, ...]
                    ) -> SimulationResult:
    """The schedule simulated over ``costs`` on the profile's pp links (each send over the
    link between the two ranks it joins, :func:`~autopp.plan.objective.pp_links`), each
    rank holding the profile's communicator allowance for its groups
    (:func:`~autopp.schedules.memory_terms.communicator_bytes` over ``mesh_shape``); the
    simulator's stage placement must be the pipeline's (``stage_ranks``), or it is a bug
    and raises."""
    from autopp.profiles import get_profile

    shape = tuple(mesh_shape)
    comm = communicator_bytes(get_profile(profile).communicator_bytes, shape)
    sim = simulate_schedule(schedule, list(costs), pp=pp, n_microbatches=n_microbatches,
                            n_stages=len(costs), link=pp_link(profile, shape),
                            links=pp_links(profile, shape, stage_ranks),
                            communicator_bytes=comm)
    return sim.check_placement(stage_ranks)


def estimate_plan(plan: Any, model: nn.Module, sub_mesh: Any, *, mode: EstimateMode = "graphs",
                  stage_modules: Sequence[nn.Module] | None = None,
                  gathering: WeightGathering = WeightGathering()) -> Any:
    """``plan`` (a :class:`~autopp.plan.value.PipelinePlan`) with simulated estimates, from
    the stage inputs and send bytes it records (no meta forward).

    ``model``: the whole model on meta (its stages are built from it unless
    ``stage_modules`` gives them); ``sub_mesh``: a stage's ("dp", "tp") sub-mesh (real or
    fake; all stages' have the same shape). ``gathering``: its ``prefetch`` (each stage is
    priced as its plan holds its weights, ``StagePlan.weight_gathering``). A plan that has
    estimates already (e.g. a dry run's) is returned as it is."""
    from autopp.stage_split import build_stage_module

    if plan.estimates is not None:
        return plan
    metas = (list(stage_modules) if stage_modules is not None else
             [build_stage_module(model, list(f), allow_tied=True) for f in plan.fqns_per_stage])
    memo: dict = {}
    costs, times = [], []
    for s, (meta, splan) in enumerate(zip(metas, plan.stage_plans)):
        _, cost = stage_estimate(meta, splan, sub_mesh, plan.stage_example_inputs(s),
                                 plan.n_microbatches, mode=mode, loss_s=splan.loss_s,
                                 send_bytes=plan.send_bytes[s], memo=memo,
                                 gathering=WeightGathering.of_stage(splan, gathering.prefetch),
                                 overlap=getattr(plan.options, "overlap_collectives", True))
        costs.append(cost)
        times.append(splan.step_time_s + splan.loss_s)
    profile = plan.options.profile
    mesh_shape = (plan.pp, plan.dp, plan.tp)
    sim = simulate_stages(plan.schedule, costs, pp=plan.pp, n_microbatches=plan.n_microbatches,
                          stage_ranks=plan.stage_ranks, profile=profile, mesh_shape=mesh_shape)
    ids = [plan.stage_ids_for_rank(r) for r in range(plan.pp)]
    return dataclasses.replace(plan, estimates=pipeline_estimates(
        sim, times, ids, plan.n_microbatches, profile, plan.options.memory_reserve,
        plan.pp * plan.dp * plan.tp))

