"""The only place autopp imports private (underscore) names of torch, torch's pipelining and
torchtitan. A torch or torchtitan upgrade that moves one of them should touch this folder only.

* :mod:`autopp._compat.sharding`: AOTAutograd's joint export and descriptors, DTensor's
  sharding propagator and op schemas, fake tensors, functional collectives, mesh flattening.
* :mod:`autopp._compat.graph`: torch's pipeline runtime IR and FX partitioner helpers, and
  torchtitan's experimental graph_pp passes, used by :mod:`autopp.graph`.
* :mod:`autopp._compat.pipelining`: ``_PipelineScheduleRuntime``, ``_Action``, CSV schedules and
  ``PipelineStage``'s first-step shape inference, used by :mod:`autopp.schedules`.
* :mod:`autopp._compat.torchtitan`: torchtitan's private pipeline-split helpers and torch's
  state-dict hook tables, used by :mod:`autopp.integrations.torchtitan`.
* :mod:`autopp._compat.distributed`: c10d's process-group internals and the fake store.
* :mod:`autopp._compat.gloo`: one worker thread per gloo process group (a workaround for a
  data race in torch's ProcessGroupGloo), installed by ``import autopp``.
* :mod:`autopp._compat.attention`: the fused SDPA kernels' aten entry points (CPU flash;
  CUDA flash, memory-efficient, cuDNN) and torch's choice among them, used by
  :mod:`autopp.ops.attention`.

A test (``tests/docs/test_layout.py``) fails on an underscore import of torch or torchtitan
anywhere else in the package.
"""
