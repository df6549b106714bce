"""The only place autopp imports private (underscore) names of torch, torch's pipelining and
torchtitan. A torch or torchtitan upgrade that moves one of them should touch this folder only.

* :mod:`~autopp._compat.sharding`: AOTAutograd's joint export, DTensor's sharding
  propagator and op schemas, fake tensors, functional collectives, mesh flattening.
* :mod:`~autopp._compat.graph`: pipeline runtime IR, FX partitioner, torchtitan's graph_pp.
* :mod:`~autopp._compat.pipelining`: ``_PipelineScheduleRuntime``, ``_Action``, CSV
  schedules, ``PipelineStage``'s shape inference (for :mod:`autopp.schedules`).
* :mod:`~autopp._compat.torchtitan`: its pipeline-split helpers and state-dict hook tables.
* :mod:`~autopp._compat.distributed`: c10d's process-group internals and the fake store.
* :mod:`~autopp._compat.gloo`: one worker thread per gloo group (a data-race workaround).
* :mod:`~autopp._compat.attention`: the fused SDPA kernels' aten entry points.

``tests/docs/test_layout.py`` fails on an underscore import of torch or torchtitan elsewhere.
"""
