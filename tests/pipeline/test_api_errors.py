"""pipeline_autoparallel rejects bad configurations with errors that name the problem.

Runs on the fake process group (8 ranks, this process is rank 0): no peers needed, since
every check fires before any communication."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopp import PlannerOptions, build_world_mesh, init_fake_world, pipeline_autoparallel
from tests.harness.models import ce_loss, llama3_meta


@pytest.fixture
def mesh222():
    init_fake_world(8)
    try:
        yield build_world_mesh(pp=2, dp=2, tp=2)
    finally:
        dist.destroy_process_group()


def _call(mesh, **kw):
    args = dict(
        example_inputs=(torch.zeros(4, 8, dtype=torch.long),),
        loss_fn=ce_loss,
        schedule="1F1B",
        n_microbatches=2,
        parallelize=None,
    )
    args.update(kw)
    model = args.pop("model", None) or llama3_meta(4)
    return pipeline_autoparallel(model, mesh, **args)


def test_valid_config_builds_layout(mesh222):
    pipe = _call(mesh222)
    assert pipe.layout.n_stages == 2 and pipe.layout.stage_ids == (0,)
    assert "stage 0 (this rank): tok_embeddings, layers.0-1" in pipe.describe()


def test_parallelize_must_be_a_backend_or_shorthand(mesh222):
    from autopp.backends import Planner, PlannerOptions, Replicate

    with pytest.raises(TypeError, match="parallelize must be a StageBackend, None, 'auto', "
                                        "'autoparallel' or a callable"):
        _call(mesh222, parallelize="fsdp")
    # planner shorthands belong to "auto"; a backend object carries its own options
    with pytest.raises(ValueError, match=r"\['memory_budget_bytes'\] are shorthands for "
                                         r"parallelize='auto'.*Planner\(PlannerOptions"):
        _call(mesh222, parallelize=Planner(PlannerOptions()),
              options=PlannerOptions(memory_budget_bytes=1e9))
    with pytest.raises(ValueError, match="compile needs the planner"):
        _call(mesh222, parallelize=None, compile=True)
    with pytest.raises(ValueError, match="boundary must be 'auto', 'batch' or 'batch\\+seq'"):
        PlannerOptions(boundary="seq")
    assert type(_call(mesh222, parallelize=Replicate()).backend) is Replicate


def test_model_must_be_on_meta(mesh222):
    from autopp import init_module_

    with pytest.raises(ValueError, match="meta device"):
        _call(mesh222, model=init_module_(llama3_meta(4), seed=0, device="cpu"))


def test_batch_not_divisible(mesh222):
    with pytest.raises(ValueError, match=r"batch size 4 is not divisible by n_microbatches=3"):
        _call(mesh222, n_microbatches=3)


def test_stages_per_rank_for_schedule(mesh222):
    with pytest.raises(ValueError, match=r"ZBVZeroBubble.*2 stages per rank"):
        _call(mesh222, schedule="ZBVZeroBubble", split=6, n_microbatches=2)


def test_unknown_schedule(mesh222):
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        _call(mesh222, schedule="OneFOneB")


def test_more_stages_than_layers(mesh222):
    with pytest.raises(ValueError, match=r"stages"):
        _call(mesh222, split=8, schedule="Interleaved1F1B")


def test_wrong_mesh_dims():
    init_fake_world(4)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        with pytest.raises(ValueError, match=r"dims \('pp', 'dp', 'tp'\)"):
            _call(mesh)
    finally:
        dist.destroy_process_group()


def test_loss_parallel_needs_cross_entropy_and_auto(mesh222):
    with pytest.raises(ValueError, match="loss_parallel=True needs loss_fn=autopp.cross_entropy"):
        _call(mesh222, parallelize="auto", options=PlannerOptions(loss_parallel=True))
    with pytest.raises(ValueError, match="needs parallelize='auto'"):
        _call(mesh222, parallelize=None, options=PlannerOptions(loss_parallel=True))


def test_mixed_precision_needs_auto(mesh222):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(ValueError, match="mixed_precision needs parallelize='auto'"):
        _call(mesh222, options=PlannerOptions(
            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))


def test_autoparallel_backend_missing_is_a_clear_error(mesh222):
    from autopp.backends.meta_autoparallel import available

    if available():
        pytest.skip("meta's AutoParallel is installed here")
    with pytest.raises(ImportError, match="meta-pytorch's AutoParallel"):
        _call(mesh222, parallelize="autoparallel")


