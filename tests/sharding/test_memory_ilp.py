"""Memory in the sharding ILP: parameter state, activations saved for the backward under a
recomputation policy (x microbatches in flight), gathered parameters; recompute="auto";
the budget's error message; the new StagePlan fields' JSON."""

from __future__ import annotations

import json

import pytest
import torch

from autopp.sharding import InfeasiblePlanError, StagePlan, plan_stage
from tests.harness.stage_request import stage_request
from autopp.sharding.chain import budget as B

from tests.harness.fake_world import BlockStack

MODES = ("none", "selective", "full")


@pytest.fixture(scope="module")
def block(llama_debug):
    return BlockStack(llama_debug, 1)


def test_activation_estimate_equals_lowered_graphs(block, make_mesh):
    """For a dp- and tp-sharded llama3 block (torchtitan's FSDP+TP parameters; activations
    planned), the plan's activation bytes per microbatch and gathered parameter bytes equal
    what the lowered, split graphs save / unshard, under each recomputation policy."""
    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.lower.memory import saved_bytes, unsharded_bytes
    from autopp.adapters.torchtitan_reference import torchtitan_param_placements
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    mesh = make_mesh(2, 2)
    x = torch.empty(8, 64, 256, device="meta")
    fixed = torchtitan_param_placements(block, ("dp", "tp"))
    (unit,) = stage_units(block)
    joint = trace_joint(unit.module, (x,))
    seen = {}
    for mode in MODES:
        plan = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                        output_placements=None, activation_factor=2.0,
                                        recompute=mode))
        (bplan,) = plan.blocks
        graphs = split_local(lower_joint(joint, bplan, mesh), recompute=mode)
        lowered, gathered = saved_bytes(graphs), unsharded_bytes(graphs)
        seen[mode] = (plan.activation_bytes, lowered, plan.gathered_param_bytes, gathered)
        assert plan.recompute == bplan.recompute == mode
        assert plan.activation_bytes == lowered, seen  # to the byte (README)
        assert plan.gathered_param_bytes == pytest.approx(gathered, rel=0.05), seen
        assert plan.memory_bytes == pytest.approx(
            plan.state_bytes + 2.0 * plan.activation_bytes + plan.gathered_param_bytes)
    assert seen["none"][3] > 0  # dp-sharded weights are gathered
    print("estimate vs lowered (activations, gathered):", seen)


def test_split_backward_row_counts_what_w_keeps_at_each_peak(block, make_mesh, monkeypatch):
    """With a split backward (``split_in_flight``), the plan's bytes W keeps from I (the
    ILP's count off the joint graph) are within 12% of the lowered W graph's inputs under
    each recomputation policy, free or with torchtitan's placements (the split places a few
    recomputed values and views on the other side: measured -8.8% to +5.4%, and -10.7% to
    +8.4% before W ran the collectives only it needs); the row holds
    the largest of a x activations + b x kept over the peaks, and the ILP's own row value
    equals that count; and the term is what makes a budget bind: a budget between the
    activations-only count and the split count is refused by the latter."""
    from autopp.adapters.torchtitan_reference import torchtitan_param_placements
    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    mesh = make_mesh(2, 2)
    x = torch.empty(8, 64, 256, device="meta")
    (unit,) = stage_units(block)
    joint = trace_joint(unit.module, (x,))
    peaks = ((3.0, 0.0), (2.0, 1.0), (0.0, 3.0))
    seen = {}
    titan = torchtitan_param_placements(block, ("dp", "tp"))
    for fixed, modes in ((titan, MODES), (None, ("full",))):  # free: the furthest case
        for mode in modes:
            plan = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                            output_placements=None, activation_factor=3.0,
                                            split_in_flight=peaks, recompute=mode))
            (bplan,) = plan.blocks
            w = split_local(lower_joint(joint, bplan, mesh),
                            recompute=mode).backward_weight_graph
            lowered = sum(p.meta["val"].numel() * p.meta["val"].element_size()
                          for p in w.graph.find_nodes(op="placeholder"))
            act, kept = plan.activation_bytes, plan.kept_for_w_bytes
            seen[mode, fixed is None] = (kept, lowered)
            assert kept == pytest.approx(lowered, rel=0.12), seen
            assert bplan.kept_for_w_bytes == kept
            held = max(a * act + b * kept for a, b in peaks)
            assert plan.memory_bytes == pytest.approx(
                plan.state_bytes + held + plan.gathered_param_bytes)
            assert plan.split_in_flight == peaks
    print("kept for W, plan vs lowered:", seen)
    # kept > activations here (full recompute: 0.5 vs 3.9 MiB), so the split row needs more
    # than 3 x activations: under a budget between the two counts, the activations-only
    # plan fits unchanged and the split-aware one must change (and not get faster) to fit
    fixed = titan
    free = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                    output_placements=None, activation_factor=3.0,
                                    recompute="full"))
    split = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                     output_placements=None, activation_factor=3.0,
                                     split_in_flight=peaks, recompute="full"))
    assert split.memory_bytes > free.memory_bytes
    budget = (split.memory_bytes + free.memory_bytes) / 2
    unaware = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                       output_placements=None, activation_factor=3.0,
                                       recompute="full", memory_budget_bytes=budget))
    assert unaware.blocks[0].nodes == free.blocks[0].nodes
    # only the polish's MIP is bounded (to keep the test short): a time limit on every solve
    # can leave the least-memory chain with no plan at all on a loaded machine
    monkeypatch.setattr(B, "POLISH_TIME_S", 1.0)
    bound = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                     output_placements=None, activation_factor=3.0,
                                     split_in_flight=peaks, recompute="full",
                                     memory_budget_bytes=budget))
    assert bound.memory_bytes <= budget < split.memory_bytes
    assert bound.blocks[0].nodes != split.blocks[0].nodes
    assert bound.step_time_s >= split.step_time_s * (1 - 1e-9)
    with pytest.raises(InfeasiblePlanError, match="kept from I to W"):
        plan_stage(stage_request(block, (x,), mesh, param_placements=fixed, output_placements=None,
                                 activation_factor=3.0, split_in_flight=peaks, recompute="full",
                                 memory_budget_bytes=bound.state_bytes))


def test_sequence_parallel_recompute_regathers_instead_of_saving(block, make_mesh):
    """Sequence-parallel block (torchtitan's TP: activations split on the sequence over tp,
    all-gathered before the column-parallel matmuls). A recomputing backward gathers them
    again from the saved shard rather than saving the gathered tp x larger value: the
    lowered backward runs all-gathers, "selective" saves less than "none" and "full" less
    than "selective", and the ILP's count equals the lowered graphs' bytes in each mode."""
    from torch.distributed.tensor import Shard

    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.lower.memory import saved_bytes
    from autopp.adapters.torchtitan_reference import torchtitan_param_placements
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    mesh = make_mesh(1, 4)
    x = torch.empty(2, 64, 256, device="meta")
    seq = (Shard(0), Shard(1))
    fixed = torchtitan_param_placements(block, ("dp", "tp"))
    (unit,) = stage_units(block)
    joint = trace_joint(unit.module, (x,))
    seen = {}
    for mode in MODES:
        plan = plan_stage(stage_request(block, (x,), mesh, param_placements=fixed,
                                        input_placements=seq, output_placements=seq,
                                        activation_factor=1.0, recompute=mode))
        (bplan,) = plan.blocks
        graphs = split_local(lower_joint(joint, bplan, mesh), recompute=mode)
        backward = [n for g in (graphs.full_backward_graph,)
                    for n in g.graph.nodes if "all_gather" in str(n.target)]
        seen[mode] = (plan.activation_bytes, saved_bytes(graphs), len(backward))
        assert plan.activation_bytes == seen[mode][1], seen  # to the byte (README)
    assert seen["none"][1] > seen["selective"][1] > seen["full"][1], seen
    assert seen["selective"][2] > seen["none"][2], seen  # the backward gathers again
    print("sequence parallel (ILP, lowered, backward all-gathers):", seen)


def test_ilp_row_matches_account_and_recompute_lowers_activations(llama_debug, make_mesh):
    """(d) none > selective > full in activation bytes (each plan free); and the ILP's
    memory row, priced, equals the exact walk of the chosen plan."""
    from autopp.sharding.chain.blocks import block_restrictions, boundary_candidates, trace_block
    from autopp.sharding.cost.model import CostModel
    from autopp.profiles.lookup import get_profile
    from autopp.sharding.ilp.solver import MemorySpec, Model

    mesh = make_mesh(2, 2)
    traced = trace_block(llama_debug.layers["0"], torch.empty(8, 64, 256, device="meta"), mesh)
    model = Model(traced.strategies, CostModel(get_profile("H100"), (2, 2)),
                  memory=MemorySpec(activation_factor=1.0, optimizer_state_factor=2.0))
    a = boundary_candidates(traced, ("dp", "tp"))[0]
    free = {}
    for mode in MODES:
        free[mode] = model.solve(*block_restrictions(traced, a, a), recompute=mode)
        priced = model.solve(*block_restrictions(traced, a, a), recompute=mode, price=1e-10)
        assert priced.ilp_memory_bytes == pytest.approx(priced.memory_bytes, rel=1e-6)
        assert priced.memory_bytes <= free[mode].memory_bytes
    acts = [free[m].activation_bytes for m in MODES]
    assert acts[0] > acts[1] > acts[2] > 0, acts
    assert free["none"].recompute_s == 0 < free["selective"].recompute_s < free["full"].recompute_s


def test_budget_forces_sharded_parameters(block, make_mesh):
    """(b) With AdamW's state counted, a budget below the replicated plan's memory shards the
    weights over dp (computed sharded: a dp-gathered weight would be held for the step)."""
    mesh = make_mesh(4, 1)
    x = torch.empty(8, 16, 256, device="meta")
    kw = dict(activation_factor=1.0, optimizer_state_factor=2.0)
    free = plan_stage(stage_request(block, (x,), mesh, **kw))
    assert all(p.placements[0] == "R" for p in free.params)  # DDP: the fastest
    budget = 0.3 * free.memory_bytes
    tight = plan_stage(stage_request(block, (x,), mesh, memory_budget_bytes=budget, **kw))
    assert tight.memory_bytes <= budget
    assert tight.state_bytes < free.state_bytes / 2
    weights = [p for p in tight.params if not p.fqn.endswith("norm.weight")]
    assert all(p.placements[0].startswith("S") for p in weights), tight.params
    assert tight.step_time_s > free.step_time_s
    assert "memory per device (estimate)" in str(tight)


@pytest.fixture(scope="module")
def long_seq_auto(block, make_mesh):
    """A block whose activations dominate: 2 microbatches in flight of batch 8 x seq 512."""
    x = torch.empty(8, 512, 256, device="meta")
    mesh = make_mesh(2, 1)
    kw = dict(activation_factor=2.0, recompute="auto")
    return x, mesh, kw, plan_stage(stage_request(block, (x,), mesh, memory_budget_bytes=30e6,
                                                 **kw))


def test_auto_recompute_when_only_recomputation_fits(block, long_seq_auto):
    """(c) A budget only recomputation meets: "auto" picks selective or full (the fastest
    that fits), records it and its cost; smaller still raises, naming the activations."""
    x, mesh, kw, plan = long_seq_auto
    assert plan.recompute in ("selective", "full") and plan.recompute_requested == "auto"
    assert plan.memory_bytes <= 30e6 and plan.recompute_s > 0
    assert plan.step_time_s == pytest.approx(plan.compute_s + plan.comm_s + plan.recompute_s)
    options = {m: (t, mem, least) for m, t, mem, least in plan.recompute_options}
    assert options["none"][0] is None and options["none"][2] > 30e6  # none cannot fit
    fitting = {m: t for m, (t, _, _) in options.items() if t is not None}
    assert plan.recompute == min(fitting, key=fitting.get)
    assert f"activation recomputation: {plan.recompute} (chosen: recompute='auto')" in str(plan)
    free = plan_stage(stage_request(block, (x,), mesh,
                                    **kw))  # no budget: recomputing only costs time
    assert free.recompute == "none" and free.recompute_s == 0
    with pytest.raises(InfeasiblePlanError) as err:
        plan_stage(stage_request(block, (x,), mesh, memory_budget_bytes=5e6, **kw))
    msg = str(err.value)
    for needle in ("activations", "per microbatch x 2 in flight", "recompute='full'",
                   "smaller microbatches", "more pipeline stages", "more dp / tp"):
        assert needle in msg, msg
    with pytest.raises(InfeasiblePlanError, match="recompute='full'.*fits"):
        kw_none = dict(kw, recompute="none")  # a fixed policy: the message names the others
        plan_stage(stage_request(block, (x,), mesh, memory_budget_bytes=10e6, **kw_none))


def test_plan_json_keeps_memory_fields_and_loads_old_json(long_seq_auto):
    """(e) The new fields survive a JSON round trip; JSON written before them still loads."""
    plan = long_seq_auto[3]
    assert StagePlan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    new_stage = ("recompute", "recompute_requested", "recompute_s", "activation_factor",
                 "activation_bytes", "gathered_param_bytes", "state_bytes", "memory_bytes",
                 "param_state_factor", "optimizer_state_factor", "recompute_options")
    new_block = ("recompute", "recompute_s", "activation_bytes", "gathered_param_bytes",
                 "state_bytes")
    for k in new_stage:
        del old[k]
    for b in old["blocks"]:
        for k in new_block:
            del b[k]
    loaded = StagePlan.from_json(json.dumps(old))
    assert loaded.recompute == "none" and loaded.activation_factor is None
    assert loaded.recompute_options == () and loaded.blocks[0].recompute == "none"
    assert loaded.params == plan.params and loaded.step_time_s == plan.step_time_s
    str(loaded)  # the report reads old plans too


def test_budgets_less_the_fixed_terms_by_hand():
    """What the step holds outside the ILP's memory row comes off each stage's budget:
    receive buffers (torch's, one per microbatch each way, at the chosen boundary's bytes;
    "batch", the largest, before the boundaries are chosen), registered buffers, and a share of the rank's communicators.

    Two stages, M = 4 microbatches, dp = 2, tp = 2. The boundary is a dp-global
    (8, 16, 32) fp32 activation: 8 * 16 * 32 / dp * 4 = 8192 bytes per device. Stage 0
    (first) holds 4 gradient buffers, 32768 bytes, and a registered 16-float buffer, 64
    bytes; stage 1 (last) holds 4 input buffers, 32768 bytes. A 1000-byte communicator
    allowance comes off whole with one stage per rank, and half each with both on one rank.
    """
    from torch import nn

    from autopp.plan.budgets import budgets_less_fixed, fixed_stage_bytes

    first = nn.Linear(2, 2, device="meta")
    first.register_buffer("table", torch.empty(16, device="meta"), persistent=False)
    metas = [first, nn.Linear(2, 2, device="meta")]
    inputs = [(torch.empty(8, 16, dtype=torch.long, device="meta"),),
              (torch.empty(8, 16, 32, device="meta"),)]
    fixed = fixed_stage_bytes(metas, inputs, n_microbatches=4, dp=2, tp=2)
    assert fixed == [32768 + 64, 32768]
    assert budgets_less_fixed([1e6, 1e6], fixed, 1000, [0, 1]) == [
        1e6 - 32832 - 1000, 1e6 - 32768 - 1000]
    assert budgets_less_fixed([5e5, 5e5], fixed, 1000, [0, 0]) == [
        5e5 - 32832 - 500, 5e5 - 32768 - 500]
    # at the boundary the plan chose: "batch+seq" splits the sequence over tp as well,
    # 4096 bytes per buffer (a "batch" default would refuse plans that fit; measured on
    # the 70B/512 search's best layout: a negative budget, every stage refused)
    at = fixed_stage_bytes(metas, inputs, n_microbatches=4, dp=2, tp=2,
                           bounds=["batch", "batch+seq", "vocab"])
    assert at == [16384 + 64, 16384]


def test_the_loss_term_off_the_last_stage_budget_by_hand():
    """The last stage's graph ends at the logits, so the ILP's row misses what its loss
    keeps: the logits and their fp32 log-probabilities, per microbatch in flight. For a
    dp-global (4, 16, 2048) microbatch at dp = 2, tp = 2: fp32 logits on the gathered
    vocabulary ("batch") are 4 * 16 * 2048 / 2 = 65536 per device, x (4 + 4) bytes =
    524288; with loss parallel a candidate ("vocab"), the smaller 1/tp of that counts:
    262144; bf16 logits: (2 + 4) bytes each; two microbatches in flight: twice."""
    from autopp.plan.budgets import loss_kept_bytes

    logits = torch.empty(4, 16, 2048, device="meta")
    assert loss_kept_bytes(logits, 2, 2, ("batch",), 1) == 524288
    assert loss_kept_bytes(logits, 2, 2, ("batch", "vocab"), 1) == 262144
    assert loss_kept_bytes(logits, 2, 2, ("batch",), 2) == 2 * 524288
    assert loss_kept_bytes(logits.to(torch.bfloat16), 2, 2, ("batch",), 1) == 65536 * 6
    assert loss_kept_bytes(torch.empty(4, 16, dtype=torch.long, device="meta"), 2, 2,
                           ("batch",), 1) == 0


def test_largest_tensor_bound_holds_in_the_lowered_graphs(block, make_mesh):
    """``largest_tensor_bytes``: no tensor the lowered forward or backward makes is larger
    (values of parameters and buffers alone aside: the step holds those); a tighter bound
    costs time; one no plan meets is dropped, and the plan says so where describe() reads."""
    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    mesh = make_mesh(2, 2)
    x = torch.empty(8, 64, 256, device="meta")
    (unit,) = stage_units(block)
    joint = trace_joint(unit.module, (x,))
    kw = dict(activation_factor=1.0, optimizer_state_factor=2.0)

    def largest(plan):
        g = split_local(lower_joint(joint, plan.blocks[0], mesh))
        return max(n.meta["val"].numel() * n.meta["val"].element_size()
                   for gm in (g.forward_graph, g.full_backward_graph) for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor))

    free = plan_stage(stage_request(block, (x,), mesh, **kw))
    times, biggest = [free.step_time_s], largest(free)
    for share in (0.6, 0.3):
        cap = share * biggest
        plan = plan_stage(stage_request(block, (x,), mesh, largest_tensor_bytes=cap, **kw))
        assert largest(plan) <= cap and not plan.degraded()
        times.append(plan.step_time_s)
    assert times == sorted(times) and times[-1] > times[0]
    hopeless = plan_stage(stage_request(block, (x,), mesh, largest_tensor_bytes=1, **kw))
    assert hopeless.step_time_s == pytest.approx(free.step_time_s)
    (note,) = hopeless.degraded()
    assert note.startswith("largest-tensor cap of 1 B dropped") and "layers.0" in note
