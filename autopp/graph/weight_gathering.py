"""The weight-gathering policy: when a stage's gathered weights exist, what that costs and
how it is reported. Its one home: the planner backend (which policy a stage runs), the
lowering (the runtime flag), the estimates (the time it adds) and ``describe`` all ask this
module, so a change to how weights are gathered is made here (and, for a new mechanism, in
:mod:`autopp.graph.callables`, which carries it out).

Two policies, chosen by ``PlannerOptions.reshard_after_forward``:

* **once per step** (default): the UNSHARD action runs the stage's unshard graph (parameter
  all-gathers and casts) once, the gathered copy stays until RESHARD after the step's last
  backward. Time: one UNSHARD per step. Memory: the copy, held all step.
* **per microbatch** (FSDP's reshard-after-forward): every forward runs the unshard graph on
  the shards and drops its outputs after use, every backward-input runs it again for the
  gathered values it reads (``StageGraphs.regather_for_backward``). Time: two UNSHARDs per
  microbatch (one in F, one in I; W reads no weights). Memory: the copy lives only during
  one F or I; the estimates still count it held all step, since the peak falls inside an F
  or an I (an upper bound; ``benchmarks/memory.py`` measures both).

The stage planner's ILP prices gathers once per step under both policies (the sharding it
picks does not see the policy; with gathers per microbatch it gets no windows to hide them
in, :func:`autopp.plan.make.collectives_ahead`); the estimates above do see it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class WeightGathering:
    """How a planned stage holds the weights its unshard graph gathers."""

    per_microbatch: bool = False
    """True: gather again for every forward and backward; False: once per step."""

    @staticmethod
    def from_options(options: Any) -> "WeightGathering":
        """The policy ``options`` (a :class:`~autopp.plan.options.PlannerOptions`) asks for."""
        return WeightGathering(per_microbatch=bool(options.reshard_after_forward))

    def regathers(self, gathered_bytes: int) -> bool:
        """The runtime's ``regather_for_backward`` for a stage whose unshard graph makes
        ``gathered_bytes`` of new memory (nothing to re-gather without gathered weights)."""
        return self.per_microbatch and gathered_bytes > 0

    def unshards_per_step(self, n_microbatches: int) -> int:
        """How many times a step runs the stage's unshard graph."""
        return 2 * n_microbatches if self.per_microbatch else 1

    def priced(self, *, forward_s: float, backward_input_s: float, unshard_s: float
               ) -> tuple[float, float, float]:
        """``(forward_s, backward_input_s, unshard_s)`` of a stage under this policy, given
        its times with the weights gathered once per step (``unshard_s``: one UNSHARD)."""
        if not self.per_microbatch:
            return forward_s, backward_input_s, unshard_s
        return forward_s + unshard_s, backward_input_s + unshard_s, 0.0

    def explain(self, gathered_bytes: int, param_bytes: int) -> str:
        """Why a stage with these bytes (per device) holds its gathered weights as it does."""
        mib = 2**20
        if gathered_bytes == 0:
            return "no weight is gathered"
        if self.per_microbatch:
            return (f"asked for (reshard_after_forward=True); the {gathered_bytes / mib:.2f} "
                    "MiB gathered copy lives only during one forward or backward")
        return (f"{param_bytes / mib:.2f} MiB of parameter shards plus this copy "
                "(reshard_after_forward=True would re-gather for every forward and "
                "backward instead)")

    def describe(self, gathered_bytes: int, param_bytes: int) -> str:
        """One ``describe()`` line: what the stage gathers, when, and why."""
        why = self.explain(gathered_bytes, param_bytes)
        if self.regathers(gathered_bytes):
            return ("re-gathers its weights for every microbatch's forward and backward "
                    f"(reshard after forward; 2 gathers per weight per microbatch): {why}")
        if gathered_bytes:
            return (f"keeps {gathered_bytes / 2**20:.2f} MiB of weights gathered once per "
                    f"step (UNSHARD to RESHARD): {why}")
        return why

    @property
    def when(self) -> str:
        """When the weights are gathered, in words."""
        return "for every forward and backward" if self.per_microbatch else "once per step"
