"""The printed form of a dry run (:class:`autopp.dry_run.DryRunReport`): ``str(report)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopp.plan.budgets import WORKSPACE_SHARE
from autopp.plan.make import describe_loss
from autopp.schedules import MEMORY_CATEGORIES
from autopp.format import format_bytes
from autopp.graph.weight_gathering import WeightGathering
from autopp.sharding.report import placement_summary

if TYPE_CHECKING:
    from autopp.dry_run.run import DryRunReport

_BOUNDARY_WORDS = {
    "batch": "batch split over dp, whole over tp",
    "batch+seq": "batch split over dp, sequence over tp",
}

_NAME = {c: c.replace("_", " ") for c in MEMORY_CATEGORIES}
_SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim",
          "gathered_parameters": "gathered", "activations": "acts", "workspace": "work", "buffers": "buffers",
          "receive_buffers": "recv", "communicators": "comm"}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _unit(peak: float) -> tuple[float, str]:
    return (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _split_line(c, from_graphs: bool, hidden_s: float = 0.0) -> str:
    how = "from the graphs" if from_graphs else "by rule: a third each"
    if hidden_s > 0:
        how += f", {_ms(hidden_s)} of communication hidden under compute"
    return (f"    per microbatch F {_ms(c.forward_s)}, I {_ms(c.backward_input_s)}, W "
            f"{_ms(c.backward_weight_s)} ({how}); per step unshard {_ms(c.unshard_s)}, "
            f"reduce-grad {_ms(c.reduce_grad_s)}")


def _stage_lines(r: DryRunReport) -> list[str]:
    lines = []
    for s in r.stages:
        p = s.plan
        c = s.cost
        lines += [
            f"  stage {s.index} (pp rank {s.pp_rank}): {s.modules}",
            f"    input {' '.join(str(list(x)) for x in s.input_shapes)}; time {_ms(s.time_s)}"
            f" (compute {_ms(p.compute_s)} + comm {_ms(p.comm_s)}"
            + (f" + loss {_ms(s.loss_s)}" if s.loss_s else "")
            + f"); params {format_bytes(p.param_bytes_per_device)}/device",
            _split_line(c, s.facts.from_graphs, s.facts.hidden_comm_s),
            f"    placements: {placement_summary(p)}",
            *([f"    kept for the backward: {format_bytes(s.activation_bytes)}/device per microbatch "
               "in flight (saved activations, from the lowered graphs; recompute "
               f"{p.recompute or 'none'}"
               + (f", chosen from {p.recompute_requested!r}" if getattr(
                   p, "recompute_requested", "") == "auto" else "")
               + ")"
               + (f"; its W keeps {format_bytes(s.facts.kept_for_w_bytes)} from I (planner: "
                  f"{format_bytes(p.kept_for_w_bytes)})" if p.split_in_flight
                  and s.facts.kept_for_w_bytes is not None else "")
               + f"; gathered/cast weights {format_bytes(c.gathered_param_bytes)} "
               + WeightGathering.of_stage(p).when]
              if s.activation_bytes is not None else []),
            f"    sends {list(s.send_shape)} = {format_bytes(s.send_bytes)} per microbatch to stage "
            f"{s.index + 1} ({_BOUNDARY_WORDS[s.boundary_out]})" if s.send_shape is not None
            else f"    last stage: {describe_loss(s.boundary_out)}",
            f"    planned in {s.plan_wall_s:.1f} s ({'cached' if s.cached else 'solved'})"
            + (f"; under its budget, stage {s.reused_from}'s plan reused"
               if s.reused_from is not None else ""),
        ]
        if s.torchtitan is not None:
            t = s.torchtitan
            tt_time = t.step_time_s + s.torchtitan_loss_s
            lines.append(
                f"    torchtitan FSDP+TP: time {_ms(tt_time)} (compute {_ms(t.compute_s)} + "
                f"comm {_ms(t.comm_s)}), params {format_bytes(t.param_bytes_per_device)}/device; "
                f"planned/torchtitan {s.time_s / tt_time:.3f}; priced in "
                f"{s.torchtitan_wall_s:.1f} s ({'cached' if s.torchtitan_cached else 'solved'})"
            )
    return lines


def memory_table(r: DryRunReport, which: str = "planned") -> list[str]:
    """Each pp rank's memory at its simulated peak, by category, and whether it fits."""
    sim = r.simulation_of(which)
    usable = r.usable_bytes
    div, unit = _unit(max(x.peak_bytes for x in sim.ranks))
    head = f"  {unit:<4} rank stages" + "".join(f"{_SHORT[c]:>10}" for c in MEMORY_CATEGORIES)
    lines = [head + "      peak  in flight  fits"]
    for rank in sim.ranks:
        m = rank.memory_at_peak
        flight = ",".join(str(sim.max_in_flight[s]) for s in rank.stages)
        fits = "yes" if rank.peak_bytes <= usable else \
            f"no (+{_gib(rank.peak_bytes - usable)} GiB)"
        lines.append(
            f"  {rank.rank:>9} {str(list(rank.stages)):<7}"
            + "".join(f"{getattr(m, c) / div:>10.2f}" for c in MEMORY_CATEGORIES)
            + f"{rank.peak_bytes / div:>10.2f}  {flight:>9}  {fits}")
    return lines


def fit_lines(r: DryRunReport, which: str = "planned") -> list[str]:
    """Why each rank that does not fit does not: its largest category at the peak."""
    sim, costs = r.simulation_of(which), r.costs_of(which)
    lines = []
    for rank in sim.ranks:
        if rank.peak_bytes <= r.usable_bytes:
            continue
        m = rank.memory_at_peak
        top = max(MEMORY_CATEGORIES, key=lambda c: getattr(m, c))
        detail = ""
        if top == "activations":
            parts = [f"stage {s}: {sim.max_in_flight[s]} microbatches in flight x "
                     f"{_gib(costs[s].activation_bytes_per_microbatch)} GiB"
                     for s in rank.stages]
            detail = " (" + "; ".join(parts) + ")"
        lines.append(
            f"  rank {rank.rank} does not fit: peak {_gib(rank.peak_bytes)} GiB > "
            f"{_gib(r.usable_bytes)} GiB usable by {_gib(rank.peak_bytes - r.usable_bytes)} "
            f"GiB; {_NAME[top]} dominate with {_gib(getattr(m, top))} GiB "
            f"({getattr(m, top) / rank.peak_bytes:.0%} of the peak){detail}")
    return lines


def _pipeline_lines(r: DryRunReport) -> list[str]:
    sim = r.simulation
    rank_t = r.rank_times_s()
    slow = max(range(r.pp), key=lambda i: rank_t[i])
    link = r.link
    bw = ("no limit" if link.bandwidth_bytes_per_s == float("inf")
          else f"{link.bandwidth_bytes_per_s / 1e9:.0f} GB/s")
    lines = [
        "",
        f"Pipeline, simulated ({sim.actions.name}: torch's action lists for {r.pp} pp ranks, "
        f"{r.n_stages} stages, {r.n_microbatches} microbatches; slowest p2p link {bw}, "
        f"{link.latency_s * 1e6:.0f} us):",
        f"  estimated step time: {_ms(r.step_time_s)}; bubble {sim.bubble_fraction:.1%} "
        "(idle share of all ranks' time)",
        "  per rank: " + "; ".join(
            f"{x.rank}: busy {_ms(x.busy_s)}, bubble {x.bubble_fraction:.1%}" for x in sim.ranks),
        f"  closed form (Alpa, any schedule): {_ms(r.alpa_time_s())} = "
        f"{_ms(sum(r._times('planned')))} + {r.n_microbatches - 1} x {_ms(rank_t[slow])} "
        f"(pp rank {slow}); p2p not included",
        "",
        f"Memory per device at each pp rank's simulated peak (usable: {_gib(r.usable_bytes)} GiB"
        f" = {r.profile} {r.device_memory_bytes / 1e9:.0f} GB minus a {r.memory_reserve:.0%} "
        "reserve; AdamW state = fp32 moments (+ fp32 master for sub-fp32 parameters); "
        "activations under each stage's planned recomputation, the last stage's with its "
        "loss's logits; recv = torch's p2p receive buffers, one per microbatch each way; "
        "work = the running action's working memory; comm = the process groups' "
        "communicator allowance; fragmentation and sent tensors held to the step's end are "
        "left to the reserve):",
        *memory_table(r),
        *fit_lines(r),
    ]
    ck = r.checkpointed_simulation
    if ck is not None:
        peaks = [x.peak_bytes + w for x, w in zip(ck.ranks, r.checkpoint_working_bytes)]
        over = [x for x, p in zip(ck.ranks, peaks) if p > r.usable_bytes]
        verdict = "all fit"
        if over:
            m = max(over, key=lambda x: x.peak_bytes).memory_at_peak
            rest = {c: getattr(m, c) for c in MEMORY_CATEGORIES if c != "activations"}
            top = max(rest, key=rest.get)
            verdict = (f"{len(over)} of {len(peaks)} ranks do not fit; at the largest peak "
                       f"{_NAME[top]} {_gib(rest[top])} GiB, all but activations "
                       f"{_gib(sum(rest.values()))} GiB")
        div, unit = _unit(max(peaks))
        lines += [
            f"  with full activation checkpointing per block (estimate, not planned: each "
            f"block's input kept, its forward recomputed in the backward): step "
            f"{_ms(ck.step_time_s)} ({ck.step_time_s / r.step_time_s - 1:+.1%}), peak per rank "
            + ", ".join(f"{p / div:.2f}" for p in peaks)
            + f" {unit}, one block's saved activations "
            f"during its recompute included ({verdict})",
        ]
    lines += [
        f"  point-to-point per step, all stage boundaries, one device per boundary: "
        f"{format_bytes(r.p2p_bytes_per_step)} (2 x {r.n_microbatches} microbatches x "
        f"{format_bytes(r.p2p_bytes_per_microbatch)} summed over boundaries)",
        "  planning: " + ", ".join(
            f"stage {s.index} {s.plan_wall_s:.1f} s {'cached' if s.cached else 'solved'}"
            for s in r.stages) + (
            f"; {r.distinct_plans} distinct stage plans made under budgets for "
            f"{r.n_stages} stages" + (" (alike stages reuse them)"
                                      if r.distinct_plans < r.n_stages else "")
            if r.distinct_plans else
            "; the whole plan read from the cache")
        + f"; dry run in total {r.wall_s:.1f} s (planning, lowering "
        "for memory and the F/I/W split, simulation)",
    ]
    return lines


def _moe_lines(r: DryRunReport) -> list[str]:
    """What the plan assumes of a mixture of experts' routing (only where it has routed
    experts): uniform, or the busiest device's share ``PlannerOptions.expert_imbalance``."""
    if not any(name.startswith("routed_experts") for s in r.stages for b in s.plan.blocks
               for name, _, _ in b.nodes):
        return []
    x = float(getattr(r.plan.options, "expert_imbalance", "1") if r.plan else 1.0)
    dims = getattr(r.plan.options, "expert_dims", "auto") if r.plan else "auto"
    pinned = ([] if dims == "auto" else
              [f"  mixture of experts: routed experts split over {dims.replace('*', ' x ')} "
               "as asked (PlannerOptions.expert_dims, an expert-parallel group as "
               "torchtitan's ep)"])
    if x == 1.0:
        return pinned + [
            "  mixture of experts: routing assumed uniform over the experts (every "
            "expert-parallel device computes and exchanges the mean share of routed "
            "tokens); PlannerOptions(expert_imbalance=x) prices the busiest device's "
            "share at x times the mean"]
    return pinned + [
        f"  mixture of experts: the busiest expert-parallel device assumed to get {x:g} "
        "times the mean share of routed tokens (PlannerOptions.expert_imbalance): its "
        "expert compute and token exchange priced so; activation memory as for uniform "
        "routing"]


def format_report(r: DryRunReport) -> str:
    dims = "/".join(r.stages[0].plan.mesh_dim_names) if r.stages else "dp/tp"
    lines = [
        f"Dry run: pp={r.pp} x dp={r.dp} x tp={r.tp} ({r.pp * r.dp * r.tp} ranks, fake process "
        f"group), schedule {r.schedule}, {r.n_stages} stages, profile {r.profile}",
        (f"  mixed precision: {r.mixed_precision}\n" if r.mixed_precision else "")
        + f"  global batch {r.global_batch} x seq {r.seq_len}, {r.n_microbatches} microbatches: "
        f"{r.microbatch_rows} row(s) per microbatch per dp rank "
        f"({r.microbatch_rows * r.dp} dp-global, what the planner sees)",
        ("  parameter-memory budget per device: torchtitan's per stage (compare)" if r.compare
         else "  memory budget per device (parameters, gradients, AdamW state, gathered "
         "weights, activations x microbatches in flight; the running action's working "
         f"memory ({2 * WORKSPACE_SHARE:.2%} of the device's), receive buffers, buffers and "
         "communicators taken off first; no tensor made within an action above "
         f"{WORKSPACE_SHARE:.2%} of it): "
         + (format_bytes(r.memory_budget_bytes) if r.memory_budget_bytes is not None
            else f"the device's memory less {r.memory_reserve:.0%}")),
        *_moe_lines(r),
        "",
        f"Stages (time = estimated fwd+bwd of one microbatch on one device; placements per "
        f"{dims}, a|b where layers differ):",
        *_stage_lines(r),
        *_pipeline_lines(r),
    ]
    if r.compare:
        tt = r.torchtitan_simulation
        lines += [
            "",
            "Against torchtitan's manual FSDP+TP layout under the same cost model and simulator:",
            f"  torchtitan simulated step time {_ms(tt.step_time_s)} (bubble "
            f"{tt.bubble_fraction:.1%}; closed form {_ms(r.alpa_time_s('torchtitan'))}), "
            f"parameter memory {format_bytes(r.param_bytes_per_device('torchtitan'))}/device",
            f"  planned / torchtitan step time: {r.step_time_ratio:.3f} (simulated), "
            f"{r.alpa_time_s() / r.alpa_time_s('torchtitan'):.3f} (closed form)",
            "  torchtitan's memory per device at each rank's peak:",
            *memory_table(r, "torchtitan"),
            *fit_lines(r, "torchtitan"),
        ]
        lines += [f"  note: {n}" for n in r.compare_notes]
    return "\n".join(lines)
