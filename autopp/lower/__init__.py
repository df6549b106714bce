"""A stage plan made local: :class:`~autopp.sharding.StagePlan` → local aten graphs with
explicit collectives, split into the pieces :mod:`autopp.graph` runs.

* :mod:`autopp.lower.local_graphs`: one planned block's joint graph → a local joint graph
  (DTensor placements → plain tensors + collectives), split into F / I / W / UNSHARD / REDUCE_GRAD.
* :mod:`autopp.lower.interpret`: runs a planned graph node by node with DTensors (the
  reference the lowered graphs are tested against).
* :mod:`autopp.lower.apply`: a materialised stage module + its plan → a sharded module.
* :mod:`autopp.lower.memory`: bytes the lowered graphs hold (saved values, gathered
  parameters, per-op workspace), measured on the graphs.
* :mod:`autopp.lower.stage`: a planned stage → a :class:`~autopp.graph.GraphStage` for torch's
  schedule runtime.
"""
