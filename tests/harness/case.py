"""One test configuration: what every rank of a multi-process launch builds and runs.

The multi-process tests hand a list of :class:`Case` to a worker (``tests/*_workers.py``)
through :func:`tests.harness.launch.run_on_ranks`; each rank builds the pipeline a case names,
runs it and returns what the test compares with the single-process reference
(:mod:`tests.harness.reference`). A variant of a case is ``dataclasses.replace(case, ...)``
(:func:`vary`); an unknown field is a ``TypeError`` at the test's own line, not a key a
worker silently never reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Case:
    """A pipeline (model, mesh, schedule, how stages are parallelised), the training it runs
    and what a worker reports besides losses and gradients."""

    # the pipeline
    schedule: str = "1F1B"
    pp: int = 2
    dp: int = 1
    tp: int = 1
    n_microbatches: int = 2
    model: str = "llama3"
    """A key of :data:`tests.harness.models.MODELS`."""
    n_layers: int = 4
    batch: int = 8
    """The global batch (each dp rank takes its slice)."""
    seq: int = 16
    parallelize: Any = "auto"
    """``"auto"`` (the planner), ``"autoparallel"``, ``None`` (replicated stages) or a
    function ``(stage, sub_mesh) -> stage``."""
    split: Any = None
    """A stage split (``pipeline_autoparallel(split=...)``); None: balanced."""
    planner_options: dict | None = None
    """``PlannerOptions`` fields: the pipeline gets ``Planner(PlannerOptions(**these))``."""
    options: dict = dataclasses.field(default_factory=dict)
    """Other ``pipeline_autoparallel`` keywords (compile) and planner option fields
    (boundary, memory_budget_bytes: passed as ``options=PlannerOptions(...)``)."""
    loss_parallel: bool = False
    """``loss_parallel=True`` with autopp's vocabulary-parallel ``cross_entropy``."""
    bf16: bool = False
    """bf16 compute with fp32 masters and gradient reductions (torchtitan's policy)."""
    fp32_experts: bool = False
    """MoE: routed experts computed in the parameters' dtype (the reference's)."""
    dispatch: str = "auto"
    """MoE: the planner's token dispatch."""
    expert_dims: str = "auto"
    """MoE: the stage-mesh dims the routed experts are split over (torchtitan's ep group)."""
    # the training
    data_seed: int = 0
    shifts: tuple[int, ...] = ()
    """Data variants stepped in turn (a keyword-input test: other masks, other documents)."""
    steps: int = 1
    lr: float = 1e-2
    max_norm: float | None = None
    resume: Any = None
    """A layout to resume the run's checkpoint in (a :class:`Case`, or (pp, dp, tp))."""
    cross: str | None = None
    """A schedule whose placement (loop or V) loads the checkpoint and saves it back."""
    checkpoint: bool = False
    # what a worker reports or expects
    eval: bool = False
    clip: bool = False
    count_collectives: bool = False
    saved_bytes: bool = False
    plan: Any = None
    """A saved plan file for ``pipeline_autoparallel(plan=...)``."""
    count_planning: bool = False
    """Count this rank's planning calls (with ``plan``: a saved plan plans nothing)."""
    expect_error: bool = False
    track: float = 1e-5
    """MoE: relative bound on a loss curve after the first steps."""


def vary(case: Case, **changes: Any) -> Case:
    """``case`` with ``changes``."""
    return dataclasses.replace(case, **changes)


PARITY_GAP = 0.1
"""The planner's ``optimality_gap`` in parity launches: they check that the runtime computes
the model's numbers on a plan that shards; how close that plan is to the fastest is the
planner tests' question (``tests/sharding``), and a 10% gap plans a memory-bound stage
several times faster."""


def parity_options(**fields: Any):
    """``PlannerOptions(**fields)`` planned at :data:`PARITY_GAP` unless ``fields`` say."""
    from autopp import PlannerOptions

    return PlannerOptions(**{"optimality_gap": PARITY_GAP, **fields})


def pipeline_keywords(case: Case, **planner: Any) -> dict[str, Any]:
    """``pipeline_autoparallel`` keywords for ``case.options`` and the ``planner`` fields
    given: the planner's options gathered into one ``options=PlannerOptions(...)``."""
    from autopp import PlannerOptions

    fields = {f.name for f in dataclasses.fields(PlannerOptions)}
    kw = {k: v for k, v in case.options.items() if k not in fields}
    planner = {**{k: v for k, v in case.options.items() if k in fields}, **planner}
    if planner:
        kw["options"] = parity_options(**planner)
    return kw
