"""``CompileOptions(bucket_collectives=True)`` makes Inductor bucket a graph's collectives,
observed in the code Inductor generates (not in the options dict): three all-gathers of
parameters, as an UNSHARD graph issues them, become one; and the planned stages' lowering
hands the options to every compiled callable."""

from __future__ import annotations

import torch
from torch import fx

from autopp.plan.options import CompileOptions

GATHER = "_c10d_functional.all_gather_into_tensor"


def _three_gathers(a, b, c):
    outs = [torch.ops._c10d_functional.all_gather_into_tensor(t, 2, "0") for t in (a, b, c)]
    outs = [torch.ops._c10d_functional.wait_tensor(t) for t in outs]
    return outs[0] * 2, outs[1] + 1, outs[2] - 1


def _gather_calls(options: CompileOptions) -> int:
    from torch._inductor.utils import run_and_get_code

    from autopp._compat.graph import inductor_compile

    torch._dynamo.reset()
    fn = inductor_compile(fx.symbolic_trace(_three_gathers), options.inductor_options())
    _, codes = run_and_get_code(fn, *[torch.randn(4, 4) for _ in range(3)])
    return sum(line.count(f"{GATHER}.default(") + line.count(f"{GATHER}_out.default(")
               for code in codes for line in code.splitlines() if not line.lstrip().startswith(("#", "assert")))


def test_bucketing_merges_the_gathers_in_the_generated_code(fake_world2):
    assert _gather_calls(CompileOptions()) == 3
    assert _gather_calls(CompileOptions(bucket_collectives=True)) == 1


def test_planned_stages_compile_every_callable_with_the_options(monkeypatch):
    import autopp.graph as graph_pkg
    from autopp.lower import stage

    seen = []
    monkeypatch.setattr(graph_pkg, "compile_stage_graphs",
                        lambda graphs, options=None: seen.append(options) or graphs)
    opts = CompileOptions(bucket_collectives=True, reorder_for_overlap=True)
    stage.compile_graphs(object(), opts)
    stage.compile_graphs(object(), True)
    assert seen == [opts.inductor_options(), None]
    assert seen[0]["reorder_for_compute_comm_overlap"] is True


def test_compile_true_buckets_and_reorders_on_cuda_only():
    from autopp.plan.options import resolve_compile

    on = CompileOptions(bucket_collectives=True, reorder_for_overlap=True)
    assert resolve_compile(True, "cuda") == CompileOptions.for_device("cuda") == on
    assert resolve_compile(True, "cpu") == CompileOptions() and not CompileOptions().inductor_options()
    mine = CompileOptions(bucket_collectives=True)  # given explicitly: used as given
    assert resolve_compile(mine, "cuda") is mine and resolve_compile(False, "cuda") is False


def test_the_planner_hands_a_cuda_stage_bucketing_and_reordering(monkeypatch):
    """``Planner(compile=True)`` on a CUDA mesh: the compiled callables get the bucketing
    and reordering options (observed where the stage's graphs are compiled)."""
    from types import SimpleNamespace

    import autopp.graph as graph_pkg
    from autopp.backends.planner import Planner
    from autopp.lower import stage

    seen = []
    monkeypatch.setattr(graph_pkg, "compile_stage_graphs",
                        lambda graphs, options=None: seen.append(options) or graphs)
    monkeypatch.setattr(stage, "planned_graph_stage",
                        lambda module, compile, **kw: stage.compile_graphs(object(), compile))
    for device_type in ("cuda", "cpu"):
        module = SimpleNamespace(mesh=SimpleNamespace(device_type=device_type))
        Planner(compile=True).pipeline_stage(0, module, n_stages=1, device=None, pp_group=None,
                                             loss_fn=None, get_mesh=None)
    module = SimpleNamespace(mesh=SimpleNamespace(device_type="cuda"))  # options given: kept
    Planner(compile=CompileOptions()).pipeline_stage(0, module, n_stages=1, device=None,
                                                     pp_group=None, loss_fn=None, get_mesh=None)
    cuda, cpu, explicit = seen
    assert cuda == {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all",
                    "bucket_all_reduces_fx": "all", "reorder_for_compute_comm_overlap": True}
    assert not cpu and not explicit
