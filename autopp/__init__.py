"""autopp: pipeline parallelism composed with automatic sharding, for PyTorch.

The public surface is small: :func:`pipeline_autoparallel` splits a meta-device model into
stages, parallelizes each over its sub-mesh and runs them under a torch pipeline schedule,
returning a :class:`Pipeline` (init_weights, step, eval, parameters, state_dict);
:func:`build_world_mesh` builds the ("pp", "dp", "tp") mesh; :func:`cross_entropy` is the
llama-style loss that lets the planner compute the loss in parallel over tp;
:func:`plan_pipeline` plans a whole pipeline into a :class:`PipelinePlan` (a value to save,
load, print and run with ``plan=``); :func:`search` ranks layouts for a number of devices;
:class:`PlannerOptions` is the planner's options, one value for all four entry points
(loose planner keywords are refused with that spelling); :func:`init_module_` initialises a
module as ``Pipeline.init_weights`` does, for single-process references."""

# first: the model adapters register their tracing contexts (autopp.tracing) before anything
# splits or traces a model; light (no torchtitan, DTensor or planner at import)
from autopp import adapters  # noqa: F401  (isort: skip)
from autopp._compat import gloo as _gloo  # isort: skip
from autopp._compat import autograd as _autograd  # isort: skip
from autopp._compat import distributed as _distributed  # isort: skip
from autopp.api import pipeline_autoparallel
from autopp.init import init_module_
from autopp.loss import cross_entropy
from autopp.mesh import build_world_mesh, init_fake_world, stage_sub_mesh
from autopp.pipeline import Pipeline, PipelineLayout
from autopp.plan.options import PlannerOptions
from autopp.plan.value import PipelinePlan

# every gloo process group created from here on gets one worker thread: torch's two race on
# the group's status and corrupt the heap (autopp/_compat/gloo.py)
_gloo.install()
# torch's leaf tree spec pickled and copied without its deprecation warning each time (plans
# sent back by forked planning processes hold many: autopp/_compat/distributed.py)
_distributed.pickle_leaf_specs_plainly()
# the autograd engine's first backward on a real tensor, before any fake-mode trace starts
# its device threads (they would break the forked planning processes: autopp/_compat/autograd.py)
_autograd.warm()

__all__ = [
    "pipeline_autoparallel",
    "Pipeline",
    "PipelineLayout",
    "PipelinePlan",
    "PlannerOptions",
    "plan_pipeline",
    "search",
    "SearchReport",
    "build_world_mesh",
    "stage_sub_mesh",
    "init_fake_world",
    "init_module_",
    "cross_entropy",
]


def __getattr__(name: str):
    """``plan_pipeline`` (the planner), ``search`` and ``SearchReport`` (the search and the
    planner) load on first use: ``import autopp`` stays light."""
    if name == "plan_pipeline":
        from autopp.plan.make import plan_pipeline

        return plan_pipeline
    if name in ("search", "SearchReport"):
        from autopp import layout_search

        return getattr(layout_search, name)
    raise AttributeError(f"module 'autopp' has no attribute {name!r}")
