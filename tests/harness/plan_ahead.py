"""Plan the slowest launches' pipelines ahead, in one process beside the suite.

Most of a planned launch's time is rank 0 planning while seven ranks wait, so the launch lane
(one launch at a time) is the suite's critical path while the single-process lane idles at
its end. ``python -m tests.harness.plan_ahead`` (started by tests/conftest.py under pytest-xdist) runs
each test of :data:`AHEAD` with its launch replaced: each case's worker runs as rank 0 on the
fake process group, where ``pipeline_autoparallel`` only plans (``autopp.plan_pipeline``,
the same request, so the same plan-cache key) and stops the worker. The launch later reads
those plans from the session's plan cache; nothing is checked here, and a case that fails
or is not done in time is planned by its launch as before (the cache's file lock makes one
process solve a key). Launches of :data:`AHEAD` run last in their lane (conftest).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

#: Launches whose plans are made ahead (pytest node ids).
AHEAD = (  # in the order the launch lane runs them (file order)
    "tests/models/test_any_decoder.py::test_tied_qwen3_and_nested_decoder_match_single_process",
    "tests/models/test_attention_check.py::"
    "test_attention_variants_planned_over_tp_and_replicated_match_the_models_own",
    "tests/models/test_gpt2_style_models.py::test_gpt2_planned_and_replicated_match_transformers",
    "tests/models/test_moe.py::test_moe_decoders_match_single_process",
    "tests/models/test_transformers_models.py::test_transformers_qwen3_planned_and_hf_checkpoints",
    "tests/models/test_transformers_moe.py::"
    "test_mixtral_planned_replicated_and_in_bf16_match_single_process",
    "tests/pipeline/test_auto_pipeline.py::test_auto_schedules_and_layouts_match_single_process",
    "tests/pipeline/test_auto_pipeline.py::test_auto_weights_gathered_and_gradients_reduced_per_block",
)

logger = logging.getLogger("tests.harness.plan_ahead")


class _Planned(Exception):
    """Ends a worker (or a test) once its pipeline is planned."""


def _plan_instead(model, mesh, *, example_inputs, loss_fn, n_microbatches, schedule="1F1B",
                  example_kwargs=None, split=None, parallelize="auto", options=None,
                  layers_attr=None, plan=None, **_: Any):
    """``pipeline_autoparallel``'s planning alone: the pipeline plan it would make."""
    from autopp import plan_pipeline
    from autopp.backends import Planner
    from autopp.mesh import mesh_sizes

    if plan is None and (parallelize == "auto" or isinstance(parallelize, Planner)):
        sizes = mesh_sizes(mesh)
        plan_pipeline(model, pp=sizes["pp"], dp=sizes["dp"], tp=sizes["tp"], mesh=mesh,
                      schedule=schedule, n_microbatches=n_microbatches,
                      example_inputs=example_inputs, example_kwargs=example_kwargs,
                      split=split, layers_attr=layers_attr, loss_fn=loss_fn,
                      options=parallelize.options if isinstance(parallelize, Planner)
                      else options)
    raise _Planned


def _plan_launch(fn, world_size: int, configs, *args: Any, **_: Any):
    """``run_on_ranks`` replaced: each case's first pipeline planned, then the test ended."""
    import torch.distributed as dist

    from autopp.mesh import init_fake_world

    for cfg in configs:
        init_fake_world(world_size)
        try:
            with mock.patch("autopp.pipeline_autoparallel", _plan_instead):
                fn(0, world_size, [cfg], *args)
        except _Planned:
            pass
        except Exception as e:  # the launch plans it itself
            logger.warning("%s: not planned ahead (%s: %s)", cfg, type(e).__name__, e)
        finally:
            dist.destroy_process_group()
    raise _Planned


def plan_test(nodeid: str, tmp: Path) -> None:
    """The pipelines of the launch ``nodeid`` planned into the plan cache."""
    path, name = nodeid.split("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    test = getattr(module, name)
    # fixtures: a directory for tmp_path; None for the others (used after the launch only)
    kwargs = {p: tmp if p == "tmp_path" else None for p in inspect.signature(test).parameters}
    # the launcher where the test module imported it, and where a test imports it itself
    with contextlib.ExitStack() as patched:
        patched.enter_context(mock.patch("tests.harness.launch.run_on_ranks", _plan_launch))
        if hasattr(module, "run_on_ranks"):
            patched.enter_context(mock.patch.object(module, "run_on_ranks", _plan_launch))
        try:
            test(**kwargs)
        except _Planned:
            pass


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(relativeCreated)8.0f ms %(name)s %(message)s")
    for noisy in ("torch", "autopp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for nodeid in AHEAD:
        t0 = time.perf_counter()
        try:
            plan_test(nodeid, Path(tempfile.mkdtemp(prefix="autopp-ahead-")))
        except Exception as e:
            logger.warning("%s: not planned ahead (%s: %s)", nodeid, type(e).__name__, e)
        logger.info("%s: planned ahead in %.1f s", nodeid, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
