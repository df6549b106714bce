"""Estimates of a planned pipeline: each stage's per-action costs and state bytes, fed to
the schedule simulator (:mod:`autopp.schedules.simulate`), and the step time and memory a
plan is reported with. The dry run, the torchtitan integration and the layout search all
use this package, so they price a plan the same way.
"""

from autopp.estimate.stage_costs import (  # noqa: F401  (the names users of autopp.estimate import)
    StageFacts,
    StateBytes,
    contended_step_s,
    full_checkpointing_cost,
    param_dtypes,
    pipeline_estimates,
    simulated_step_s,
    stage_cost,
    stage_facts,
    stage_facts_by_rule,
    state_bytes,
    usable_bytes,
)
from autopp.plan.objective import pp_link  # noqa: F401  (the one pp link)
