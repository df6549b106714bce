"""A readable report of a :class:`~autopp.sharding.plan.StagePlan`."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING

from autopp.format import format_bytes

if TYPE_CHECKING:
    from autopp.sharding.plan import StagePlan


def _time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def _pl(strs: tuple[str, ...], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}:{s}" for n, s in zip(names, strs))


def _memory_line(plan: StagePlan) -> str:
    """The memory row's estimate by category."""
    if plan.optimizer_state_factor is not None:
        state = (f"parameters + gradients + optimizer state (x{plan.optimizer_state_factor:g}) "
                 f"{format_bytes(plan.state_bytes, digits=1)}")
    else:
        state = f"parameter state (x{plan.param_state_factor:g}) {format_bytes(plan.state_bytes, digits=1)}"
    act = f"activations {format_bytes(plan.activation_bytes, digits=1)} per microbatch"
    if plan.activation_factor is None:
        return f"  memory per device (estimate): {state}; {act} (not in the budget)"
    budget = ("" if plan.memory_budget_bytes is None
              else f" (budget {format_bytes(plan.memory_budget_bytes, digits=1)})")
    if plan.split_in_flight:
        kept = format_bytes(plan.kept_for_w_bytes, digits=1)
        held = " | ".join(f"{a:g}/{b:g}" for a, b in plan.split_in_flight)
        act = (f"{act} and {kept} kept from I to W, held as the most of (F->I)/(I->W) "
               f"microbatches {held}")
    else:
        act = f"{act} x {plan.activation_factor:g} in flight"
    return (f"  memory per device (estimate): {state} + {act} + gathered parameters {format_bytes(plan.gathered_param_bytes, digits=1)} = "
            f"{format_bytes(plan.memory_bytes, digits=1)}{budget}")


def _recompute_line(plan: StagePlan) -> str:
    """The recomputation policy, how it was chosen and what it costs."""
    how = " (chosen: recompute='auto')" if plan.recompute_requested == "auto" else ""
    line = f"  activation recomputation: {plan.recompute}{how}"
    if plan.recompute != "none":
        line += f", recomputes {_time(plan.recompute_s)} of forward per microbatch"
    others = []
    for mode, t, mem, least in plan.recompute_options:
        if mode == plan.recompute:
            continue
        others.append(f"{mode}: {_time(t)}, {format_bytes(mem, digits=1)}" if t is not None
                      else f"{mode}: does not fit (needs at least {format_bytes(least, digits=1)})")
    if others:
        line += "; " + "; ".join(others)
    if plan.time_bound_s is not None and plan.memory_budget_bytes is not None:
        gap = (plan.step_time_s - plan.time_bound_s) / max(plan.step_time_s, 1e-30)
        line += (f"\n  under the budget: within {max(gap, 0.0):.2%} of the certified bound "
                 f"{_time(plan.time_bound_s)} (no fitting plan is faster)")
    if any(plan.comm_windows_s):
        line += (f"\n  once-per-step collectives: {_time(plan.hidden_comm_s)} a step expected "
                 f"hidden beside compute (windows: weight gathers "
                 f"{_time(plan.comm_windows_s[0])}, gradient reductions "
                 f"{_time(plan.comm_windows_s[1])} a step); chosen by the time left exposed")
    return line


def format_plan(plan: StagePlan, max_collectives: int = 40) -> str:
    names = plan.mesh_dim_names
    mesh = " x ".join(f"{n}={s}" for n, s in zip(names, plan.mesh_shape))
    lines = [
        f"StagePlan on mesh {mesh}, profile {plan.profile}",
        f"  estimated step time (fwd+bwd, one device): {_time(plan.step_time_s)} "
        f"= compute {_time(plan.compute_s)} + communication {_time(plan.comm_s)}"
        + (f" + recomputation {_time(plan.recompute_s)}" if plan.recompute_s else ""),
        f"  parameter memory per device: {format_bytes(plan.param_bytes_per_device, digits=1)}"
        + (
            f" (budget {format_bytes(plan.memory_budget_bytes, digits=1)})"
            if plan.memory_budget_bytes is not None
            else " (no budget)"
        ),
        _memory_line(plan),
        _recompute_line(plan),
        (f"  mixed precision: parameters computed in {plan.param_dtype}, gradients reduced "
         "in the master dtype\n" if plan.param_dtype else "")
        + f"  input placements: {_pl(plan.input_placements, names)}; "
        f"output placements: {_pl(plan.output_placements, names)}",
        (f"  loss: {plan.loss}, estimated {_time(plan.loss_s)}\n" if plan.loss else "")
        + f"  blocks: {len(plan.blocks)} ({len({b.signature for b in plan.blocks})} distinct), "
        f"ILP variables {plan.num_vars}, solver {plan.solve_s:.2f} s, planning {plan.plan_s:.2f} s",
        "",
        "Parameters (placement per mesh dim):",
    ]
    width = max((len(p.fqn) for p in plan.params), default=10)
    for p in plan.params:
        lines.append(f"  {p.fqn:<{width}}  {_pl(p.placements, names):<16}  {format_bytes(p.local_bytes, digits=1)}")
    lines += ["", "Collectives (kind over mesh dim: count, bytes per device, time):"]
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        a = agg[c.kind, c.mesh_dim]
        a[0] += 1
        a[1] += c.bytes
        a[2] += c.time_s
    for (kind, dim), (n, b, t) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  {kind:<15} over {dim:<4} x{int(n):<4} {format_bytes(b, digits=1):>12}  {_time(t)}")
    lines += ["", f"Largest collectives (of {len(plan.collectives)}):"]
    for c in sorted(plan.collectives, key=lambda c: -c.time_s)[:max_collectives]:
        where = f"{c.block}:" if c.block else ""
        lines.append(
            f"  {c.kind:<15} {c.mesh_dim:<4} {format_bytes(c.bytes, digits=1):>12} {_time(c.time_s):>10}  "
            f"{where}{c.producer} -> {c.node}"
        )
    lines += ["", "Fallbacks (replicated, no DTensor rule):"]
    lines += [f"  {f}" for f in plan.fallbacks] or ["  none"]
    if plan.notes:
        lines += ["", "Notes:"] + [f"  {n}" for n in plan.notes]
    return "\n".join(lines)


def placement_summary(plan: StagePlan) -> str:
    """Distinct placements by parameter (layer indices folded): ``wqkv S(0)/S(0), ...``."""
    seen: dict[str, set[str]] = defaultdict(set)
    for p in plan.params:
        name = re.sub(r"^layers\.\d+\.", "", p.fqn).removesuffix(".weight")
        name = name.split(".")[-1]
        seen[name].add("/".join(p.placements))
    return ", ".join(f"{n} {'|'.join(sorted(v))}" for n, v in seen.items())
