"""Stage backends: how each pipeline stage is parallelized over its sub-mesh.

Pass one as ``pipeline_autoparallel(..., parallelize=...)``; the shorthands still work:
``"auto"`` is :class:`Planner` (with ``options=PlannerOptions(...)`` as its options),
``None`` is :class:`Replicate`, a callable is :class:`Parallelize`, ``"autoparallel"`` is
:class:`AutoParallel`. Write your own by subclassing :class:`StageBackend`.
"""

from autopp.backends.autoparallel import AutoParallel
from autopp.backends.base import PipelineSpec, StageBackend
from autopp.plan.options import CompileOptions, PlannerOptions
from autopp.backends.planner import Planner
from autopp.backends.replicate import Replicate
from autopp.backends.user_fn import Parallelize, ParallelizeFn

__all__ = [
    "AutoParallel",
    "CompileOptions",
    "Parallelize",
    "ParallelizeFn",
    "PipelineSpec",
    "Planner",
    "PlannerOptions",
    "Replicate",
    "StageBackend",
]
