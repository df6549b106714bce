"""The weight-gathering policy: when a stage's gathered weights and unreduced gradients exist,
what that costs and how it is reported. The one home: the planner backend, the lowering, the
estimates and ``describe`` all ask this module, so a change of policy is made here (and, for
the mechanism, in :mod:`autopp.graph.per_block` / :mod:`autopp.graph.callables`).

* ``"once_per_step"`` (default): UNSHARD gathers the stage once, the copy stays until the
  step's last backward; gradients are summed unreduced and REDUCE_GRAD reduces once. Memory:
  the whole stage's gathered copy and unreduced gradients, all step.
* ``"per_block"`` (FSDP's): each block gathered before its forward and again for its
  backward (never saved), gradients reduced as made every microbatch, gathers issued
  ``prefetch`` blocks ahead. Time: gathers in every F and I, reductions in every W, each
  block's but the first hidden under the block before. Memory: ``prefetch + 1`` blocks
  gathered, gradients reduced."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

POLICIES = ("once_per_step", "per_block", "auto")
"""The values of ``PlannerOptions.weight_gathering``."""


def exposed_s(comm_s: Any, compute_s: Any, units: Any) -> Any:
    """Exposed time of ``comm_s`` of per-block collectives run beside ``compute_s`` of the
    same piece, one block ahead: the first block's in full, the rest less the compute of
    the blocks before them. Floats, or numpy arrays priced element by element at once (the
    layout search's columns of layer counts); a float for floats."""
    n = np.maximum(units, 1)
    first = comm_s / n
    out = np.where(np.asarray(units) <= 1, comm_s,
                   first + np.maximum(0.0, comm_s - first - compute_s * (n - 1) / n))
    return float(out) if out.ndim == 0 else out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WeightGathering:
    """How a planned stage holds the weights its unshard graph gathers and the gradients
    its reduce-grad graph reduces."""

    per_block: bool = False
    """True: gathered and reduced block by block, every microbatch; False: once per step."""
    prefetch: int = 1
    """Per block: how many blocks ahead a block's gathers are issued."""

    @staticmethod
    def from_options(options: Any) -> "WeightGathering":
        """The policy ``options`` (a :class:`~autopp.plan.options.PlannerOptions`) asks for."""
        return WeightGathering(per_block=options.weight_gathering == "per_block",
                               prefetch=options.prefetch_blocks)

    @staticmethod
    def of_stage(stage_plan: Any, prefetch: int = 1) -> "WeightGathering":
        """The policy a stage's plan was made for (``StagePlan.weight_gathering``: under
        ``weight_gathering="auto"`` each stage has its own)."""
        return WeightGathering(per_block=getattr(stage_plan, "weight_gathering",
                                                 "once_per_step") == "per_block",
                               prefetch=prefetch)

    def unshards_per_step(self, n_microbatches: int) -> int:
        """How many times a step gathers each of the stage's weights."""
        return 2 * n_microbatches if self.per_block else 1

    def priced(self, *, forward_s: float, backward_input_s: float, backward_weight_s: float,
               unshard_s: float, reduce_grad_s: float, units: int, overlap: bool = True
               ) -> tuple[float, float, float, float, float]:
        """``(F, I, W, UNSHARD, REDUCE_GRAD)`` seconds of a stage under this policy, given
        its times with the weights gathered once per step (``unshard_s``: one UNSHARD,
        ``reduce_grad_s``: one REDUCE_GRAD) and its number of blocks. Per block, the
        gathers join F and I, the reductions W (B is I + W), each exposed as
        :func:`exposed_s` says with ``overlap`` (else in full)."""
        if not self.per_block:
            return forward_s, backward_input_s, backward_weight_s, unshard_s, reduce_grad_s
        n = units if overlap else 1
        return (forward_s + exposed_s(unshard_s, forward_s if overlap else 0.0, n),
                backward_input_s + exposed_s(unshard_s, backward_input_s if overlap else 0.0, n),
                backward_weight_s + exposed_s(reduce_grad_s,
                                             backward_weight_s if overlap else 0.0, n),
                0.0, 0.0)

    def gathered_bytes(self, stage_bytes: int, largest_unit_bytes: int) -> int:
        """Gathered weights a stage holds at its peak: all of them once per step, per block
        the ``prefetch + 1`` blocks in flight (the largest block's, an upper bound)."""
        if not self.per_block:
            return stage_bytes
        return min(stage_bytes, (self.prefetch + 1) * largest_unit_bytes)

    def unreduced_grad_bytes(self, reduced: int, unreduced: int) -> int:
        """The gradients a stage accumulates over a step's microbatches: unreduced once per
        step, reduced (the parameters' size) per block."""
        return reduced if self.per_block else unreduced

    def workspace(self, work: dict[str, int], grads: dict[str, int],
                  largest_unit_grads: dict[str, int]) -> dict[str, int]:
        """Working memory per action kind (``work``, with every unit's fresh gradients
        ``grads`` in it): per block only two units' fresh gradients exist at once (the
        block whose reductions are in flight and the one being computed)."""
        if not self.per_block:
            return work
        return {k: v - grads.get(k, 0) + min(grads.get(k, 0),
                                             2 * largest_unit_grads.get(k, 0))
                for k, v in work.items()}

    def explain(self, gathered_bytes: int, param_bytes: int) -> str:
        """Why a stage with these bytes (per device) holds its gathered weights as it does."""
        mib = 2**20
        if gathered_bytes == 0:
            return "no weight is gathered"
        if self.per_block:
            return (f"weight_gathering='per_block': of the {gathered_bytes / mib:.2f} MiB "
                    f"gathered copy only {self.prefetch + 1} block(s) exist at a time, and "
                    "gradients are held reduced")
        return (f"{param_bytes / mib:.2f} MiB of parameter shards plus this copy "
                "(weight_gathering='per_block' would gather block by block for every "
                "forward and backward instead)")

    def describe(self, gathered_bytes: int, param_bytes: int) -> str:
        """One ``describe()`` line: what the stage gathers, when, and why."""
        why = self.explain(gathered_bytes, param_bytes)
        if self.per_block and gathered_bytes:
            return ("gathers its weights block by block for every microbatch's forward and "
                    f"backward and reduce-scatters each block's gradients as they are made "
                    f"(per block, prefetch {self.prefetch}): {why}")
        if gathered_bytes:
            return (f"keeps {gathered_bytes / 2**20:.2f} MiB of weights gathered once per "
                    f"step (UNSHARD to RESHARD): {why}")
        return why

    @property
    def when(self) -> str:
        """When the weights are gathered, in words."""
        return "block by block for every forward and backward" if self.per_block \
            else "once per step"
