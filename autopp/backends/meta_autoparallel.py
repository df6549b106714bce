"""meta-pytorch's AutoParallel as an optional planner backend (``parallelize="autoparallel"``).

AutoParallel plans one SPMD mesh with a flat ILP; it is not on PyPI (the PyPI package named
``autoparallel`` is unrelated: never install it). When ``autoparallel.api.AutoParallel``
imports, each stage is handed to it over its dp × tp sub-mesh, batch split over dp and whole
over tp at both ends (what neighbouring stages exchange), as torchtitan's integration does.
Its module computes with DTensor semantics, so gradients are sums over dp: the backend tells
the pipeline not to scale the loss by dp.

What a stage must give it: inputs made on the mesh's device inside its input function (it
calls that under its own fake mode); floating inputs requiring grad (else earlier stages get
no gradient); only mesh dims larger than 1 (it crashes on size-1 dims; the module is
replicated over the rest). Tested by ``tests/pipeline/test_autoparallel_backend.py`` where the wheel
is installed."""

from __future__ import annotations

import contextlib
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

    # AutoParallel crashes on size-1 mesh dims (a DTensor view-op KeyError): plan over the
    # dims larger than 1; the module is then replicated over the others.
    names = tuple(n for n in sub_mesh.mesh_dim_names if sub_mesh[n].size() > 1)
    if not names:
        return stage  # one device: nothing to parallelize
    mesh = sub_mesh[names] if len(names) > 1 else sub_mesh[names[0]]
    batch = tuple(Shard(0) if n == "dp" else Replicate() for n in names)
    specs = [(tuple(t.shape), t.dtype) for t in inputs]
    device = torch.device(sub_mesh.device_type)

    def input_fn():
        # called by AutoParallel under its fake mode: inputs on the mesh's device; floating
        # inputs require grad so the traced graph computes their gradient (else the earlier
        # stages would get none)
        made = []
        for shape, dtype in specs:
            if dtype.is_floating_point:
                made.append(torch.empty(shape, dtype=dtype, device=device).requires_grad_(True))
            else:
                made.append(torch.zeros(shape, dtype=dtype, device=device))
        return tuple(made) if len(made) > 1 else made[0]

    with _device_name_for_cost_model(), \
            AutoParallel(stage, input_fn, mesh, mixed_precision) as autop:
        autop.add_parameter_memory_constraint(low=None, high=None)
        autop.add_input_constraints([batch] * len(specs))
        autop.add_output_constraints([batch])
        placement = autop.optimize_placement()
        module = autop.apply_placement(placement)
    return module


@contextlib.contextmanager
def _device_name_for_cost_model():
    """AutoParallel picks its cost model by GPU name; without a GPU, say "H100" (as its own
    tests do) while it plans."""
    if torch.cuda.is_available():
        yield
        return
    name = lambda *a, **k: "H100"  # noqa: E731
    saved = {mod: getattr(mod, "get_device_name", None) for mod in (torch.cuda, torch.cpu)}
    for mod in saved:
        mod.get_device_name = name
    try:
        yield
    finally:
        for mod, fn in saved.items():
            if fn is None:
                del mod.get_device_name
            else:
                mod.get_device_name = fn
