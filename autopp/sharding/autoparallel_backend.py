"""meta-pytorch's AutoParallel as an optional planner backend (``parallelize="autoparallel"``).

AutoParallel (github.com/meta-pytorch/autoparallel) plans one SPMD mesh with a flat ILP over
the whole module; it is not on PyPI (the PyPI package named ``autoparallel`` is unrelated and
must not be installed). When ``autoparallel.api.AutoParallel`` is importable, autopp can hand
each pipeline stage to it instead of its own planner: each stage is planned over its dp × tp
sub-mesh with the batch split over dp and whole over tp at both ends (what the neighbouring
stages exchange), as torchtitan's AutoParallel integration constrains it.

AutoParallel's module computes with DTensor semantics, so its parameter gradients are sums
over dp (like autopp's own planned stages): the :class:`autopp.backends.AutoParallel`
backend tells the pipeline not to scale the loss by dp.

Not exercised by autopp's tests: AutoParallel cannot be installed on the machines autopp is
tested on. Only the error when it is missing is tested.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

def available() -> bool:
    """Whether ``autoparallel.api.AutoParallel`` can be imported."""
    if importlib.util.find_spec("autoparallel") is None:
        return False
    try:
        from autoparallel.api import AutoParallel  # noqa: F401
    except ImportError:
        return False
    return True


def missing_error() -> ImportError:
    """The error for ``parallelize="autoparallel"`` without AutoParallel installed."""
    return ImportError(
        "parallelize='autoparallel' needs meta-pytorch's AutoParallel "
        "(pip install git+https://github.com/meta-pytorch/autoparallel; NOT the PyPI "
        "package named autoparallel); or use parallelize='auto', autopp's own planner"
    )


def autoparallel_stage(
    stage: nn.Module, sub_mesh: DeviceMesh, inputs: Sequence[torch.Tensor],
    mixed_precision=None,
) -> nn.Module:
    """Plan and apply ``stage`` (on meta) over ``sub_mesh`` with AutoParallel.

    Args:
        stage: the stage module on the meta device.
        sub_mesh: the stage's ("dp", "tp") sub-mesh.
        inputs: the stage's example inputs for one dp-global microbatch (meta).
        mixed_precision: torch's ``MixedPrecisionPolicy``, passed to AutoParallel.

    Raises:
        ImportError: AutoParallel is not installed (autopp's own planner, ``"auto"``, needs
            nothing extra).
    """
    if not available():
        raise missing_error()
    from autoparallel.api import AutoParallel

    names = tuple(sub_mesh.mesh_dim_names)
    batch = tuple(Shard(0) if n == "dp" else Replicate() for n in names)
    inputs = tuple(inputs)

    def input_fn():
        return inputs if len(inputs) > 1 else inputs[0]

    with AutoParallel(stage, input_fn, sub_mesh, mixed_precision) as autop:
        autop.add_parameter_memory_constraint(low=None, high=None)
        autop.add_input_constraints([batch] * len(inputs))
        autop.add_output_constraints([batch])
        placement = autop.optimize_placement()
        module = autop.apply_placement(placement)
    return module
