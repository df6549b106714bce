"""The error a stage raises when no plan fits its memory budget: the largest consumers of
its least-memory plan, and what would make it fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopp.sharding.ilp.memory_row import MemorySpec

if TYPE_CHECKING:
    from autopp.sharding.chain.budget import Chain, Stage


def _gib(b: float) -> str:
    return f"{b / 2**30:.3g} GiB" if abs(b) >= 2**30 else f"{b / 2**20:.3g} MiB"


def over_budget_message(stage: Stage, budget: float, memory: MemorySpec,
                         tried: list[tuple[str, Chain | None, Chain]],
                         others: list[tuple[str, Chain]]) -> str:
    """Name the largest consumers of the least-memory plan and what would make it fit."""
    f = memory.activation_factor
    mode, _, least = min(tried, key=lambda t: t[2].memory_bytes)
    state, act, gath = (least.total("state_bytes"), least.total("activation_bytes"),
                        least.total("gathered_bytes"))
    state_name = ("parameters + gradients + optimizer state"
                  if memory.optimizer_state_factor is not None
                  else "parameters")
    parts = [(state, f"{state_name} {_gib(state)}")]
    kept = least.total("kept_for_w_bytes")
    held = memory.held_bytes(act, kept) if f is not None else 0.0
    if f is not None and memory.splits:
        parts.append((held, f"activations {_gib(act)} per microbatch and {_gib(kept)} kept "
                            f"from I to W, held at the peak = {_gib(held)}"))
    elif f is not None:
        parts.append((act * f, f"activations {_gib(act)} per microbatch x {f:g} in flight "
                               f"= {_gib(act * f)}"))
        parts.append((gath, f"gathered parameters {_gib(gath)}"))
    parts.sort(key=lambda p: -p[0])
    # no activation factor: the bound is PlannerOptions.parameter_budget_bytes
    option = "memory_budget_bytes" if f is not None else "parameter_budget_bytes"
    lines = [
        f"the stage does not fit {option}={budget:.4g} ({_gib(budget)}) per "
        f"device: its least-memory plan (recompute={mode!r}) needs "
        f"{_gib(least.memory_bytes)} ({_gib(least.memory_bytes - budget)} over), largest "
        "first: " + "; ".join(text for _, text in parts) + "."
    ]
    policies = [(m, lm) for m, _, lm in tried if m != mode] + others
    if policies:
        lines.append("Least memory under the other recomputation policies: " + "; ".join(
            f"recompute={m!r} {_gib(lm.memory_bytes)} (activations "
            f"{_gib(lm.total('activation_bytes'))} per microbatch)"
            + (" - fits" if lm.memory_bytes <= budget else "") for m, lm in policies) + ".")
    lines.append("What would make it fit:")
    fitting = [m for m, lm in others if lm.memory_bytes <= budget]
    if fitting:
        lines.append(f"  - activation recomputation: recompute={fitting[-1]!r} (or 'auto')")
    if f is not None and act > 0:
        lines.append(f"  - smaller microbatches: activations scale with the microbatch size "
                     f"(half the size saves ~{_gib(held / 2)}); more microbatches per "
                     "step do not lower the microbatches in flight under 1F1B")
    n_units = len(stage.kinds)
    lines.append(f"  - more pipeline stages: this stage's {n_units} unit(s) hold "
                 f"{_gib(least.memory_bytes)}; half of them would need ~"
                 f"{_gib(least.memory_bytes / 2)}")
    lines.append(f"  - more dp / tp devices for the stage: the least-memory plan already shards "
                 f"parameters, state and activations as far as this mesh allows; twice the "
                 f"devices roughly halve the {_gib(state + held + gath)}")
    if f is None:
        lines.append("  (parameter_budget_bytes bounds the parameters, their gradients and "
                     "optimizer state; activations and gathered parameters are not counted)")
    return "\n".join(lines)
