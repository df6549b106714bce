"""autopp's predictions in torchtitan's log: the simulated step, memory and tokens/s.

At startup :func:`autopp.estimate.pipeline.estimate_plan` prices the pipeline's plan as the
dry run does, without planning again, over the pipeline's own schedule; rank 0 computes the
estimates and broadcasts them (:func:`estimates_on_rank0`). They use the planner's device
profile ("CPU" on CPU processes), so beside a measured run they inform, not check.

:class:`PredictedThroughput` prints the predicted tokens per second per device after each of
torchtitan's metrics lines, beside its measured ``tps`` (global batch tokens per step over
the world size and the step time), from the second line on: the first interval holds the
first step's lazy initialisation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal


#: How estimates are made: "graphs" (lower every stage's plan to read its activation memory
#: and split its time into F / I / W, as the dry run does), "rule" (F = I = W = a third of
#: the plan's time, no activation memory: cheaper, the peaks undercount), "off".
EstimateMode = Literal["graphs", "rule", "off"]


def estimates_on_rank0(compute: Callable[[], Any]) -> tuple[Any, str | None]:
    """``compute()`` on rank 0 of the world, broadcast to every rank: ``(value, None)``, or
    ``(None, why)`` when it failed (on rank 0; the job goes on without estimates). Without
    peers (no process group, one rank, the fake group) this process computes it."""
    def local() -> tuple[Any, str | None]:
        try:
            return compute(), None
        except Exception as e:  # estimates are informative: never stop the job
            return None, f"{type(e).__name__}: {e}"

    from autopp.plan.rank0 import broadcast_from_rank0

    return broadcast_from_rank0(local, what="estimating the plan")


def tokens_per_step_per_device(plan) -> int:
    """Tokens of one step's global batch over the world size (torchtitan's tps numerator:
    one dp rank's batch tokens over the non-data-parallel degree pp x tp)."""
    return math.prod(plan.input_shapes[0]) // (plan.pp * plan.tp)


def predicted_tps(plan) -> float | None:
    """Tokens per second per device at the simulated step time (None without estimates)."""
    e = plan.estimates
    if e is None or e.step_time_s <= 0:
        return None
    return tokens_per_step_per_device(plan) / e.step_time_s


def startup_summary(plan, pp_rank: int) -> str:
    """One line: the simulated step, bubble, this pp rank's peak by category, the tps."""
    e = plan.estimates
    mib = 2**20
    peak, cats = e.peak_bytes[pp_rank], e.memory_at_peak[pp_rank]
    peaks = ", ".join(f"{p / mib:.1f}" for p in e.peak_bytes)
    return (f"autopp predicted (profile {plan.options.profile}, schedule {plan.schedule} "
            f"simulated): step {e.step_time_s * 1e3:.3f} ms, bubble {e.bubble_fraction:.1%}, "
            f"tps {predicted_tps(plan):,.0f} per device "
            f"({tokens_per_step_per_device(plan):,} tokens per step per device); "
            f"peak memory per device {peak / mib:.1f} MiB on this pp rank {pp_rank} ("
            + ", ".join(f"{c} {b / mib:.1f}" for c, b in cats)
            + f"), by pp rank [{peaks}] MiB, "
            + ("fits" if peak <= e.usable_bytes else "does NOT fit")
            + f" {e.usable_bytes / mib:.0f} MiB")


class PredictedThroughput:
    """Wraps a torchtitan ``MetricsProcessor``'s ``log``: after its metrics line, from the
    second line on, logs the predicted tps next to the measured one, and passes
    ``autopp/predicted_tps`` to its TensorBoard / WandB loggers."""

    def __init__(self, metrics_processor, plan, *, logger) -> None:
        self.metrics = metrics_processor
        self.plan = plan
        self.tps = predicted_tps(plan)
        self.logger = logger
        self.lines = 0
        self._log = metrics_processor.log
        metrics_processor.log = self.log  # this instance only

    def _measured_tps(self) -> float:
        m = self.metrics
        dt = time.perf_counter() - m.time_last_log
        return m.ntokens_since_last_log / (dt * m.parallel_dims.non_data_parallel_size)

    def log(self, step: int, *args, extra_metrics: dict[str, Any] | None = None, **kwargs):
        measured = self._measured_tps()
        extra = dict(extra_metrics or {})
        extra["autopp/predicted_tps"] = self.tps
        out = self._log(step, *args, extra_metrics=extra, **kwargs)
        self.lines += 1
        if self.lines > 1:  # the first interval holds the first step's lazy initialisation
            self.logger.info(
                f"step: {step:2}  autopp tps predicted: {self.tps:,.0f}  measured: "
                f"{measured:,.0f}  measured/predicted: {measured / self.tps:.2f}  "
                f"(simulated step {self.plan.estimates.step_time_s * 1e3:.3f} ms, profile "
                f"{self.plan.options.profile})")
        return out

    def unwrap(self) -> None:
        if self.metrics.log == self.log:
            self.metrics.log = self._log
