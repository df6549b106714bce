"""Dry run: a whole pipeline planned on one machine with the fake process group, its step
estimate and memory from the schedule simulator.

The fake process group needs a fresh process, so the dry runs run in a subprocess that prints
the report's figures as JSON; plans are cached in a temporary directory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopp.format import compact_modules
from autopp.estimate.stage_costs import (
    StageFacts,
    full_checkpointing_cost,
    stage_cost,
    state_bytes,
)
from autopp.schedules import Link, StageCost, simulate_schedule
from autopp.graph.weight_gathering import WeightGathering
from autopp.sharding.plan import CollectivePlan, ParamPlan, StagePlan

ROOT = Path(__file__).resolve().parents[2]

CODE = r"""
import dataclasses, json, sys
from tests.harness.models import llama3_meta
from autopp.dry_run import dry_run

def figures(r):
    sim = r.simulation
    return dict(
        n_stages=r.n_stages, ids=[list(i) for i in r.stage_ids_per_rank],
        times=[s.time_s for s in r.stages], send=[s.send_bytes for s in r.stages],
        send_shape=[s.send_shape and list(s.send_shape) for s in r.stages],
        mem=[s.plan.param_bytes_per_device for s in r.stages],
        act=[s.activation_bytes for s in r.stages],
        costs=[dataclasses.asdict(s.cost) for s in r.stages],
        hidden=[s.facts.hidden_comm_s for s in r.stages],
        link=dataclasses.asdict(r.link), schedule=r.schedule,
        step=r.step_time_s, alpa=r.alpa_time_s(), bubble=r.bubble_fraction,
        peaks=[x.peak_bytes for x in sim.ranks],
        at_peak=[dataclasses.asdict(x.memory_at_peak) for x in sim.ranks],
        in_flight=list(sim.max_in_flight), usable=r.usable_bytes, fits=r.fits(),
        memory=r.param_bytes_per_device(), p2p=r.p2p_bytes_per_step,
        kinds=[s.boundary_out for s in r.stages], tp=r.tp, text=str(r),
        windows=[list(s.plan.comm_windows_s) for s in r.stages],
        plan_hidden=[s.plan.hidden_comm_s for s in r.stages],
        once=[list(s.plan.once_per_step_s()) for s in r.stages], describe=r.plan.describe(),
    )

out = {}
# 1F1B: one stage per pp rank; trace and PNG of the simulated step
r = dry_run(llama3_meta(), pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
            global_batch=8, seq_len=64, compare=True, trace=sys.argv[1], timeline=sys.argv[2])
out["1F1B"] = figures(r)
out["1F1B"]["ratio"] = r.step_time_ratio
out["1F1B"]["tt_step"] = r.torchtitan_step_time_s
out["1F1B"]["tt_costs"] = [dataclasses.asdict(c) for c in r.costs_of("torchtitan")]
# the same again: its plan now from the cache, so each stage is costed after the whole
# plan (the first costed each stage in the process that planned it, right after)
again = dry_run(llama3_meta(), pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
                global_batch=8, seq_len=64, compare=True)
out["1F1B"]["again"] = dict(costs=[dataclasses.asdict(s.cost) for s in again.stages],
                            tt_costs=[dataclasses.asdict(c) for c in again.costs_of("torchtitan")],
                            act=[s.activation_bytes for s in again.stages],
                            cached=[s.cached for s in again.stages])
# Interleaved1F1B: two stages per pp rank (the fake world is set up again)
out["Interleaved1F1B"] = figures(dry_run(llama3_meta(4), pp=2, dp=2, tp=2,
                                         schedule="Interleaved1F1B", n_microbatches=2,
                                         global_batch=8, seq_len=64))
# a sequence tp does not divide: sequence-split boundaries are not candidates, not an error
odd = dry_run(llama3_meta(), pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
              global_batch=8, seq_len=63, activations=False)
out["odd_seq_boundaries"] = [s.boundary_out for s in odd.stages]
out["odd_by_rule"] = [s.facts.from_graphs for s in odd.stages]
# the options a job would pass are the options the dry run plans with and reports against
from autopp.backends import PlannerOptions
opts = PlannerOptions(memory_reserve=0.3, recompute="none", boundary="batch")
mine = dry_run(llama3_meta(), pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
               global_batch=8, seq_len=64, activations=False, options=opts)
out["options"] = dict(reported=mine.memory_reserve, planned=mine.plan.options.memory_reserve,
                      recompute=list(mine.plan.recompute), asked=mine.plan.options.recompute,
                      boundaries=list(mine.plan.boundaries), profile=mine.profile,
                      usable=mine.plan.estimates.usable_bytes if mine.plan.estimates else None,
                      device=mine.device_memory_bytes)
# weights gathered block by block: the plan records the mode and the report says it
pb = dry_run(llama3_meta(), pp=2, dp=2, tp=2, schedule="1F1B", n_microbatches=2,
             global_batch=8, seq_len=64, options=PlannerOptions(
                 weight_gathering="per_block", recompute="none", boundary="batch"))
out["per_block"] = dict(text=str(pb), mode=pb.plan.options.weight_gathering)
# weight_gathering="auto" under a budget once per step meets only by recomputing
gathering = {}
for wg in ("once_per_step", "per_block", "auto"):
    g = dry_run(llama3_meta(), pp=2, dp=4, tp=1, schedule="1F1B", n_microbatches=2,
                global_batch=8, seq_len=16, activations=False, options=PlannerOptions(
                    profile="CPU", memory_budget_bytes=4.5e7, weight_gathering=wg))
    gathering[wg] = [dict(mode=p.weight_gathering, recompute=p.recompute, time=p.step_time_s,
                          notes=list(p.notes)) for p in g.plan.stage_plans]
out["auto_gathering"] = gathering
# a split backward (ZBV) over MoE layers: what W keeps from I, planned and lowered
from tests.harness.models import deepseek_v3_meta
z = dry_run(deepseek_v3_meta(4), pp=2, dp=2, tp=2, schedule="ZBVZeroBubble",
            n_microbatches=4, global_batch=8, seq_len=16, options=PlannerOptions(profile="H100"))
out["moe_kept_for_w"] = [[s.modules, s.plan.kept_for_w_bytes, s.facts.kept_for_w_bytes]
                         for s in z.stages]
try:
    dry_run(llama3_meta(), pp=2, dp=2, tp=2, n_microbatches=2, global_batch=8, seq_len=64,
            memory_reserve=0.3)
except TypeError as e:
    out["loose"] = str(e)
print("JSON" + json.dumps(out))
"""

GLOBAL_BATCH, DP, N_MB, SEQ, DIM = 8, 2, 2, 64, 256  # debugmodel dim 256, fp32


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dry")
    env = dict(os.environ, AUTOPP_PLAN_CACHE=str(tmp / "plans"))
    trace, png = tmp / "step.json", tmp / "step.png"
    proc = subprocess.run([sys.executable, "-c", CODE, str(trace), str(png)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    out = json.loads(line[4:])
    out["files"] = (trace, png)
    return out


def _simulate(r, schedule=None, costs=None):
    return simulate_schedule(schedule or r["schedule"],
                             [StageCost(**c) for c in (costs or r["costs"])],
                             pp=len(r["ids"]), n_microbatches=N_MB, n_stages=r["n_stages"],
                             link=Link(**r["link"]))


def test_stages_time_and_p2p_bytes(reports):
    r = reports["1F1B"]
    assert r["n_stages"] == 2 and r["ids"] == [[0], [1]]
    assert r["step"] > 0 and all(t > 0 for t in r["times"])
    rows = GLOBAL_BATCH // DP // N_MB  # local microbatch rows
    assert r["send_shape"] == [[rows, SEQ, DIM], None]
    assert r["send"] == [rows * SEQ * DIM * 4, 0]
    assert [c["p2p_bytes_per_microbatch"] for c in r["costs"]] == r["send"]
    assert r["p2p"] == 2 * N_MB * rows * SEQ * DIM * 4
    assert r["memory"] == max(r["mem"])
    # what a microbatch keeps for its backward is at least one boundary-sized activation
    # (the stage's own input, which it saves as it is, lives in the receive buffer)
    assert all(a >= rows * SEQ * DIM * 4 for a in r["act"]), r["act"]
    # the last stage also keeps its loss's logits and their fp32 log-probabilities
    # (test_last_stage_keeps_the_logits_for_its_loss)
    assert [c["activation_bytes_per_microbatch"] for c in r["costs"]][:-1] == r["act"][:-1]
    assert "kept for the backward" in r["text"]
    assert "stage 0 (pp rank 0): tok_embeddings, layers.0-2" in r["text"]
    assert "stage 1 (pp rank 1): layers.3-5, norm, lm_head" in r["text"]
    assert "Pipeline, simulated (1F1B" in r["text"] and "closed form (Alpa" in r["text"]
    # compare=True prices torchtitan's layout under the same costs and memory: never better
    # per stage; the simulated pipelines are compared too
    assert r["tt_step"] > 0 and r["ratio"] == pytest.approx(r["step"] / r["tt_step"])
    assert "torchtitan FSDP+TP" in r["text"] and "torchtitan simulated step" in r["text"]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_step_time_is_the_simulators(reports, schedule):
    r = reports[schedule]
    assert r["step"] == pytest.approx(_simulate(r).step_time_s, rel=1e-12)
    # the closed formula stays as a secondary figure
    t = r["times"]
    per_rank = [sum(t[s] for s in ids) for ids in r["ids"]]
    assert r["alpa"] == pytest.approx(sum(t) + (N_MB - 1) * max(per_rank), rel=1e-12)
    assert r["memory"] == max(sum(r["mem"][s] for s in ids) for ids in r["ids"])


def test_torchtitan_step_is_simulated_too(reports):
    r = reports["1F1B"]
    assert r["tt_step"] == pytest.approx(_simulate(r, costs=r["tt_costs"]).step_time_s,
                                         rel=1e-12)


def test_schedules_differ_on_the_same_stages(reports):
    """Same stages and costs, another schedule: another simulated step; the closed form
    cannot tell them apart."""
    r = reports["Interleaved1F1B"]
    looped = _simulate(r, "LoopedBFS").step_time_s
    zero_bubble = _simulate(r, "InterleavedZeroBubble").step_time_s
    assert looped != pytest.approx(r["step"], rel=1e-6)
    assert zero_bubble != pytest.approx(r["step"], rel=1e-6)
    assert zero_bubble != pytest.approx(looped, rel=1e-6)


def test_time_split_adds_up_to_the_plan(reports):
    """F + I + W per microbatch, the communication they hide under compute, and UNSHARD
    and REDUCE_GRAD at 1/M each is the plan's fwd+bwd time (the loss included); exact for
    fp32 (no casts run once per step)."""
    for name in ("1F1B", "Interleaved1F1B"):
        r = reports[name]
        for c, t, hidden in zip(r["costs"], r["times"], r["hidden"]):
            assert hidden >= 0
            total = (c["forward_s"] + c["backward_input_s"] + c["backward_weight_s"] + hidden
                     + (c["unshard_s"] + c["reduce_grad_s"]) / N_MB)
            assert total == pytest.approx(t, rel=1e-9)
            assert c["forward_s"] > 0 and c["backward_input_s"] > 0 and c["backward_weight_s"] > 0
    assert reports["odd_by_rule"] == [False, False]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_memory_categories_add_up_to_the_peak(reports, schedule):
    r = reports[schedule]
    for rank, (ids, peak, cats) in enumerate(zip(r["ids"], r["peaks"], r["at_peak"])):
        assert sum(cats.values()) == peak
        costs = [r["costs"][s] for s in ids]
        # static categories: the sum over the rank's stages (fp32 parameters: AdamW's two
        # fp32 moments are twice the parameter bytes, and there is no master copy)
        assert cats["parameters"] == sum(r["mem"][s] for s in ids)
        assert cats["optimizer"] == 2 * cats["parameters"]
        assert cats["activations"] <= sum(r["in_flight"][s] * c["activation_bytes_per_microbatch"]
                                          for s, c in zip(ids, costs))
        assert r["fits"][rank] == (peak <= r["usable"])
    # 1F1B keeps min(M, pp - s) microbatches in flight on stage s
    assert reports["1F1B"]["in_flight"] == [2, 1]
    assert "Memory per device at each pp rank's simulated peak" in reports["1F1B"]["text"]


VOCAB = 2048  # llama3 debugmodel


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_last_stage_keeps_the_logits_for_its_loss(reports, schedule):
    """The planned graph ends at the logits (the loss runs eagerly after it), so its saved
    values hold neither the logits nor cross entropy's log-probabilities; the last stage's
    activations add both, by hand: rows x seq x vocab fp32 logits per device (1/tp of the
    vocabulary under loss parallel), 4 bytes each, plus as many fp32 log-probabilities."""
    r = reports[schedule]
    rows = GLOBAL_BATCH // DP // N_MB
    vocab = VOCAB // (r["tp"] if r["kinds"][-1] == "vocab" else 1)
    kept = r["costs"][-1]["activation_bytes_per_microbatch"] - r["act"][-1]
    assert kept == rows * SEQ * vocab * (4 + 4)
    # its backward's working memory holds at least the logits' gradient (fp32)
    last = r["costs"][-1]
    assert max(last["backward_workspace_bytes"],
               last["backward_input_workspace_bytes"]) >= rows * SEQ * vocab * 4
    # every backward allocates (its gradients at least); a forward whose intermediates are
    # all saved or returned has no working memory of its own
    assert all(c["backward_workspace_bytes"] > 0 for c in r["costs"])


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_receive_buffers_buffers_and_communicators_in_the_peak(reports, schedule):
    """Held all step, so at every rank's peak: torch's receive buffers, one per microbatch
    each way (a stage's input buffers unless it is the first, its output-gradient buffers
    unless it is the last, each the boundary's bytes); the stages' registered buffers (the
    RoPE table each stage holds a copy of); the H100 profile's 64 MiB per process group,
    three groups at pp=2 x dp=2 x tp=2."""
    r = reports[schedule]
    n, send = r["n_stages"], r["send"]
    for ids, cats in zip(r["ids"], r["at_peak"]):
        recv = sum(N_MB * ((send[s - 1] if s > 0 else 0) + (send[s] if s < n - 1 else 0))
                   for s in ids)
        assert cats["receive_buffers"] == recv > 0
        assert cats["buffers"] == sum(r["costs"][s]["buffer_bytes"] for s in ids) > 0
        assert cats["communicators"] == 3 * 64 * 2**20
    assert " recv " in r["text"] and " comm" in r["text"]


def test_trace_and_timeline_written(reports):
    trace, png = reports["files"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "0F0" for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_says_when_weights_are_gathered(reports):
    """The stage lines say how the plan holds its gathered weights, and a per-block plan
    records its mode (a saved plan run again is checked against it)."""
    assert "weights" in reports["1F1B"]["text"] and "once per step" in reports["1F1B"]["text"]
    assert reports["per_block"]["mode"] == "per_block"
    text = reports["per_block"]["text"]
    assert "weights" in text and "block by block" in text and "once per step" not in text, text


def test_auto_weight_gathering_chooses_per_stage(reports):
    """``weight_gathering="auto"``: a stage that fits once per step without recomputing
    keeps it; one that must recompute to fit (as under this budget) is also planned block
    by block and keeps the faster plan, the note saying why."""
    g = reports["auto_gathering"]
    assert any(st["recompute"] != "none" for st in g["once_per_step"]), g
    for once, block, auto in zip(g["once_per_step"], g["per_block"], g["auto"]):
        if once["recompute"] == "none":
            assert auto["mode"] == "once_per_step", auto
            continue
        faster = block if block["time"] < once["time"] else once
        assert (auto["mode"], auto["time"]) == (faster["mode"], faster["time"]), (auto, faster)
        said = "block by block" if faster is block else "once per step"
        assert any(n.startswith(f"weights gathered {said}") for n in auto["notes"]), auto
    assert any(st["mode"] == "per_block" for st in g["auto"]), g  # the budget makes it pay


def test_odd_sequence_falls_back_to_batch_boundaries(reports):
    assert reports["odd_seq_boundaries"][0] == "batch"


def test_interleaved_two_stages_per_rank(reports):
    r = reports["Interleaved1F1B"]
    assert r["n_stages"] == 4 and r["ids"] == [[0, 2], [1, 3]]
    assert r["send"][:3] == [GLOBAL_BATCH // DP // N_MB * SEQ * DIM * 4] * 3 and r["send"][3] == 0


def _plan(params, collectives=(), param_dtype="torch.bfloat16") -> StagePlan:
    return StagePlan(
        mesh_shape=(4, 2), mesh_dim_names=("dp", "tp"), profile="H100", params=tuple(params),
        input_placements=("S(0)", "R"), output_placements=("S(0)", "R"), blocks=(),
        collectives=tuple(collectives), step_time_s=0.0, compute_s=0.0, comm_s=0.0,
        param_bytes_per_device=sum(p.local_bytes for p in params), memory_budget_bytes=None,
        fallbacks=(), num_vars=0, solve_s=0.0, plan_s=0.0, param_dtype=param_dtype)


def test_plans_with_the_options_it_reports_against(reports):
    """The reserve, recompute and boundaries the dry run is given are those its plan was
    made with (before, it planned with a 10% reserve and checked fits against the
    caller's); loose planner keywords are refused with the spelling that works."""
    o = reports["options"]
    assert o["reported"] == o["planned"] == 0.3
    assert o["asked"] == "none" and set(o["recompute"]) == {"none"}
    assert set(o["boundaries"][1:-1]) == {"batch"}
    assert o["profile"] == "H100"
    assert o["usable"] == pytest.approx(0.7 * o["device"])
    assert "options=PlannerOptions(memory_reserve=0.3)" in reports["loose"]


def test_state_bytes_by_hand():
    """A stage of two weights on a dp=4 x tp=2 sub-mesh, bf16 compute.

    ``w``: 64 x 32 stored in fp32, sharded on dp and tp: 64 * 32 / 8 = 256 local elements.
    ``v``: 128 stored in bf16, replicated: 128 local elements.
    """
    w_local, v_local = 64 * 32 // 8, 128
    plan = _plan([ParamPlan("w", ("S(0)", "S(1)"), w_local * 4),
                  ParamPlan("v", ("R", "R"), v_local * 2)],
                 # w's gradient is reduce-scattered over dp from a dp-unsharded fp32 tensor
                 [CollectivePlan("", "w", "mm_1", "reduce_scatter", "dp", 4 * w_local * 4, 1e-3)])
    st = state_bytes(plan, {"w": torch.float32, "v": torch.bfloat16})
    assert st.parameters == 256 * 4 + 128 * 2 == 1280
    assert st.gradients == 1280  # a gradient has its parameter's dtype and placement
    assert st.unreduced_gradients == 4 * 256 * 4 + 128 * 2 == 4352
    # AdamW: fp32 w is its own master: two fp32 moments (8 B); bf16 v: fp32 master + two
    # fp32 moments (12 B)
    assert st.optimizer == 256 * 8 + 128 * 12 == 3584

    facts = StageFacts(forward_s=1.0, backward_input_s=2.0, backward_weight_s=1.5,
                       unshard_s=0.25, reduce_grad_s=0.5, activation_bytes=1000,
                       kept_for_w_bytes=600, gathered_bytes=4096, checkpoint_bytes=100)
    c = stage_cost(facts, st, loss_s=0.2, p2p_bytes=64)
    assert (c.forward_s, c.backward_input_s, c.backward_weight_s) == (1.1, 2.1, 1.5)
    assert (c.unshard_s, c.reduce_grad_s, c.p2p_bytes_per_microbatch) == (0.25, 0.5, 64)
    assert (c.param_bytes, c.grad_bytes, c.unreduced_grad_bytes, c.optimizer_bytes) == (
        1280, 1280, 4352, 3584)
    assert (c.gathered_param_bytes, c.activation_bytes_per_microbatch,
            c.activation_bytes_kept_for_w) == (4096, 1000, 600)
    # per block, one block (no overlap to gain): the stage's gathers in every F and every
    # I, its reductions in every W; the gathered copy is the one block's, gradients reduced
    again = stage_cost(facts, st, loss_s=0.2, gathering=WeightGathering(per_block=True))
    assert (again.forward_s, again.backward_input_s) == pytest.approx((1.35, 2.35))
    assert (again.unshard_s, again.reduce_grad_s) == (0.0, 0.0)
    assert again.backward_weight_s == pytest.approx(2.0)
    assert again.unreduced_grad_bytes == again.grad_bytes == 1280
    # four blocks of 1024 gathered bytes each, prefetch 1: two blocks held, and each
    # block's gathers but the first hide under the compute of the block before it
    four = dataclasses.replace(facts, units=4, largest_unit_gathered_bytes=1024)
    blk = stage_cost(four, st, gathering=WeightGathering(per_block=True))
    assert blk.gathered_param_bytes == 2 * 1024
    assert blk.forward_s == pytest.approx(1.0 + 0.25 / 4)  # 0.1875 s left hide under 0.75 s
    assert blk.backward_weight_s == pytest.approx(1.5 + 0.5 / 4)
    assert stage_cost(four, st, gathering=WeightGathering(per_block=True),
                      overlap=False).forward_s == pytest.approx(1.25)
    ck = full_checkpointing_cost(c, facts)  # keeps block inputs, recomputes F before I
    assert ck.activation_bytes_per_microbatch == 100
    assert ck.backward_input_s == pytest.approx(2.1 + 1.0)
    assert dataclasses.replace(ck, activation_bytes_per_microbatch=1000,
                               backward_input_s=2.1) == c


def test_compact_modules():
    assert compact_modules(["tok_embeddings", "layers.0", "layers.1", "layers.2"]) == (
        "tok_embeddings, layers.0-2")
    assert compact_modules(["layers.5", "norm", "lm_head"]) == "layers.5, norm, lm_head"
    assert compact_modules(["layers.1", "layers.3"]) == "layers.1, layers.3"


def test_stages_are_planned_against_the_windows_their_schedule_leaves(reports):
    """Interleaved1F1B on 2 pp ranks: rank 0's stages (0 and 2) wait for nothing before
    their first action and end the step, so they get no window; rank 1's two stages share
    its windows equally, and each expects hidden what its collectives take up to them.
    The 1F1B run compares against torchtitan under parameter budgets (the legacy
    accounting): no windows there."""
    r = reports["Interleaved1F1B"]
    assert r["ids"] == [[0, 2], [1, 3]]
    w = r["windows"]
    assert w[0] == w[2] == [0.0, 0.0]
    assert w[1] == w[3] and w[1][0] > 0 and w[1][1] > 0, w
    for s in range(4):
        once = [x * N_MB for x in r["once"][s]]  # a step
        assert r["plan_hidden"][s] == pytest.approx(
            sum(min(c, win) for c, win in zip(once, w[s])), rel=1e-9, abs=1e-15)
    assert r["plan_hidden"][1] > 0
    assert "once-per-step collectives" in r["describe"]
    assert all(x == [0.0, 0.0] for x in reports["1F1B"]["windows"])


def test_costed_after_each_stage_or_after_the_cached_plan_alike(reports):
    """The first 1F1B dry run plans its stages and costs each right after its plan, in the
    process that planned it (``plan_whole_pipeline(after_stage=)``); run again, its plan
    comes from the cache and the stages are costed after it: the same costs."""
    r = reports["1F1B"]
    assert all(r["again"]["cached"])  # the whole plan from the cache
    assert r["again"]["costs"] == r["costs"] and r["again"]["tt_costs"] == r["tt_costs"]
    assert r["again"]["act"] == r["act"]


def test_what_w_keeps_from_i_is_planned_as_lowered_over_moe_layers(reports):
    """Under a split backward (ZBVZeroBubble) the planner's bytes W keeps from I per
    microbatch are within 10% of the lowered W graph's inputs on every stage of deepseek_v3,
    MoE layers included: the routed experts' backward is one kernel run in I, so W keeps
    its weight gradients (counting the op's inputs instead gave a quarter of them)."""
    rows = reports["moe_kept_for_w"]
    assert len(rows) == 4
    for modules, planned, lowered in rows:
        assert lowered > 0 and planned == pytest.approx(lowered, rel=0.10), (modules, rows)
