"""``autopp.search``: the layouts it considers (hand-checked), its messages for inputs nothing
can train, and an end-to-end search of the debug model whose best layout, planned exactly
by the dry run, simulates to the step time the search predicted for it."""

from __future__ import annotations


import pytest

from autopp.layout_search import Layout, enumerate_layouts


pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


def test_layouts_of_eight_devices_by_hand():
    layouts, rejected = enumerate_layouts(world_size=8, global_batch=16, n_layers=4,
                                          devices_per_node=8, schedules=("1F1B",),
                                          microbatch_choices=2)
    # (pp, dp, tp): pp*dp*tp = 8, pp <= 4 layers, dp | 16; 1F1B needs m >= pp, m | 16/dp
    expected = set()
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if 8 % (tp * pp) or pp > 4:
                continue
            dp = 8 // (tp * pp)
            local = 16 // dp
            ms = [m for m in (1, 2, 4, 8, 16) if local % m == 0 and m >= pp]
            picked = []
            for m in ms:
                if not picked or m >= 2 * picked[-1]:
                    picked.append(m)
            expected |= {Layout(pp, dp, tp, "1F1B", 1, m) for m in picked[:2]}
    assert set(layouts) == expected
    assert ("pp8 dp1 tp1", "pp=8 is more than the model's 4 layers (every stage holds one)") \
        in rejected


def test_tp_stays_in_a_node_and_v_schedules_need_two_stages_per_rank():
    layouts, rejected = enumerate_layouts(world_size=16, global_batch=64, n_layers=8,
                                          devices_per_node=4,
                                          schedules=("ZBVZeroBubble", "Interleaved1F1B"))
    assert max(lay.tp for lay in layouts) == 4
    assert any("tp=8 spans nodes" in r for _, r in rejected)
    assert all(lay.stages_per_rank == 2 for lay in layouts
               if lay.pp > 1 and lay.schedule == "ZBVZeroBubble")
    # a looped schedule tries 2, 3 and 4 stages per rank, as far as the 8 layers go
    looped = {(lay.pp, lay.stages_per_rank) for lay in layouts
              if lay.schedule == "Interleaved1F1B"}
    assert {(2, 2), (2, 3), (2, 4), (4, 2)} <= looped and (4, 3) not in looped
    assert all(lay.n_stages <= 8 for lay in layouts)


def test_world_size_that_factors_into_nothing_valid():
    # 13 devices: tp 13 spans nodes, pp 13 exceeds 6 layers, dp 13 does not divide 8
    with pytest.raises(ValueError, match="no pp x dp x tp layout of 13 devices") as e:
        enumerate_layouts(world_size=13, global_batch=8, n_layers=6, devices_per_node=8)
    assert "What would work" in str(e.value) and "world size such as" in str(e.value)


def test_global_batch_too_small_for_any_pipeline():
    # tp at most 2 per node: 8 devices need pp >= 2 or dp >= 2; 1 sequence cannot feed either
    with pytest.raises(ValueError, match="cannot make the microbatches|not divisible"):
        enumerate_layouts(world_size=8, global_batch=1, n_layers=6, devices_per_node=2)


@pytest.fixture(scope="module")
def debug_model():
    import torch

    from tests.harness.models import llama3_meta

    torch.manual_seed(0)
    return llama3_meta(6)


def test_model_that_fits_nowhere(debug_model):
    import autopp
    from autopp.profiles.devices import PROFILES, register_profile, with_overrides

    tiny = with_overrides(PROFILES["H100"], name="H100-1MiB", memory_bytes=2**20)
    register_profile(tiny)
    report = autopp.search(debug_model, world_size=4, global_batch=8, seq_len=64,
                           options=autopp.PlannerOptions(profile="H100-1MiB"),
                           schedules=("1F1B",), tp_sizes=(1, 2))
    assert report.results == ()
    assert all("does not fit" in r for _, r in report.rejected if "GiB" in r)
    with pytest.raises(ValueError, match="no layout of 4 devices fits.*What would make it fit"):
        report.best


def test_search_debug_model_best_layout_simulates_as_predicted(debug_model):
    import autopp

    report = autopp.search(debug_model, world_size=8, global_batch=16, seq_len=64,
                           options=autopp.PlannerOptions(profile="H100"),
                           schedules=("1F1B", "Interleaved1F1B"), microbatch_choices=2)
    print(report)
    times = [c.step_time_s for c in report.results]
    assert times == sorted(times) and len(times) >= 4
    for c in report.results:
        layers = [f for stage in c.fqns_per_stage for f in stage if f.startswith("layers.")]
        assert layers == [f"layers.{i}" for i in range(6)]
        assert c.fits and 0 < c.mfu < 1 and len(c.recompute) == c.layout.n_stages
    best = report.best
    dry = report.plan(0)  # the exact plan of the best layout: every stage, every boundary
    assert dry.plan.fqns_per_stage == best.fqns_per_stage
    # the search rescales probe plans; the dry run plans each stage exactly
    print(f"best {best.layout}: search {best.step_time_s * 1e3:.3f} ms, "
          f"planned exactly {dry.step_time_s * 1e3:.3f} ms")
    # README: the search's prediction for a layout within 2% of its exact plan
    assert dry.step_time_s == pytest.approx(best.step_time_s, rel=0.02), (
        dry.step_time_s, best.step_time_s)


def test_llama3_8b_head_on_512_dp_ranks_is_planned():
    """llama3-8B's head on a dp=512 sub-mesh (a 2 TiB replicated-logits option beside
    one-byte terms) made HiGHS's presolve call the unit infeasible, and the search left
    FSDP over 512 ranks out as "could not plan"; the solver now solves such a model again
    without presolve."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    import autopp

    with torch.device("meta"):
        model = build_decoder_config_for_backend(llama3_configs["8B"], "sdpa").build()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    report = autopp.search(model, world_size=512, global_batch=512, seq_len=8192,
                           options=autopp.PlannerOptions(profile="H100", mixed_precision=mp),
                           tp_sizes=(1,), pp_sizes=(1,),
                           schedules=("1F1B",), microbatch_choices=1, recompute=("none",),
                           workers=1)
    reasons = [r for _, r in report.rejected]
    assert not any("could not plan" in r for r in reasons), reasons
    assert report.results or any(r.startswith("does not fit") for r in reasons), reasons


def test_pruning_keeps_the_best_and_bounds_hold(debug_model):
    """Left-out layouts are dominated: the search with pruning finds the same best layout as
    the one that simulates every layout, and each layout it left out as dominated simulates,
    in the full search, to no less than the bound it was left out with."""
    import re

    import autopp

    kw = dict(world_size=8, global_batch=16, seq_len=64,
              options=autopp.PlannerOptions(profile="H100"),
              schedules=("1F1B", "Interleaved1F1B", "ZBVZeroBubble"), microbatch_choices=2)
    pruned = autopp.search(debug_model, max_results=3, **kw)
    full = autopp.search(debug_model, max_results=None, **kw)
    assert pruned.best.layout == full.best.layout
    assert pruned.best.step_time_s == full.best.step_time_s
    steps = {str(c.layout): c.step_time_s for c in full.results}
    dominated = [(lay, float(re.search(r"at least ([\d.e+-]+) ms", why).group(1)))
                 for lay, why in pruned.rejected if why.startswith("dominated")]
    assert dominated, "the debug model's search left nothing out: the test checks nothing"
    for lay, bound_ms in dominated:
        assert steps[lay] * 1e3 >= bound_ms * (1 - 1e-3), (lay, steps[lay], bound_ms)


def test_no_fit_message_names_each_kind_of_reason_and_only_its_remedies():
    """A planner failure is named as one (not hidden behind a divisibility reason), and
    memory remedies are offered only when some layout did not fit in memory."""
    from autopp.layout_search.search import SearchReport

    def report(rejected):
        return SearchReport(results=(), rejected=tuple(rejected), world_size=7, global_batch=8,
                            seq_len=64, profile="H100", mixed_precision=None, n_evaluated=1,
                            n_submeshes=1, stage_plans_solved=0, search_s=0.0)

    shape = ("pp1 dp7 tp1", "global batch 8 is not divisible by dp=7")
    planner = ("pp1 dp1 tp7 1F1B m1", "the planner could not plan this sub-mesh: "
                                      "output_placements (Replicate(), Shard(dim=1)) matches "
                                      "no block-boundary placement")
    msg = report([shape, planner]).no_fit_message()
    assert "1 layout(s): the planner failed (e.g. pp1 dp1 tp7 1F1B m1: the planner could not" \
        in msg and "1 layout(s): sizes do not divide" in msg, msg
    assert "tp_sizes" in msg and "larger device" not in msg, msg
    memory = ("pp2 dp2 tp1 1F1B m2", "does not fit: stage 0 needs ~3.0 GiB of 1.0 GiB")
    assert "larger device" in report([memory]).no_fit_message()


def test_a_probe_bug_is_told_from_a_planner_refusal(monkeypatch, caplog):
    """A probe that raises something other than the planner's refusals (a ValueError) is
    reported as autopp's bug, logged with the way to see its traceback, and named first in
    the no-fit message; a refusal stays "the planner could not plan"."""
    import logging

    import torch.distributed as dist

    from autopp import init_fake_world
    from autopp.layout_search import probe_pool
    from autopp.layout_search.search import SearchReport

    monkeypatch.setattr(probe_pool, "JOB", dict(world=2, global_batch=2, seq_len=8, model=None,
                                                layout=None, profile="CPU", mp=None,
                                                tf32=False))
    errors = iter([TypeError("'NoneType' object is not subscriptable"),
                   ValueError("output_placements (Shard(dim=1),) matches no placement")])

    def raising(*a, **k):
        raise next(errors)

    monkeypatch.setattr(probe_pool, "probe_costs", raising)
    init_fake_world(2)
    try:
        with caplog.at_level(logging.WARNING, logger="autopp.layout_search.probe_pool"):
            bug = probe_pool.probe_job(1, 2, 1, 1, ("none",))
        refusal = probe_pool.probe_job(1, 2, 1, 1, ("none",))
    finally:
        dist.destroy_process_group()
    assert bug == (probe_pool.PROBE_BUG + "TypeError: 'NoneType' object is not subscriptable")
    assert any("AUTOPP_TRACEBACK=1" in r.getMessage() for r in caplog.records), caplog.text
    assert refusal.startswith("the planner could not plan this sub-mesh: output_placements")
    report = SearchReport(results=(), rejected=(("pp1 dp1 tp2 1F1B m1", bug),
                                                ("pp1 dp1 tp2 GPipe m1", refusal)),
                          world_size=2, global_batch=2, seq_len=8, profile="CPU",
                          mixed_precision=None, n_evaluated=2, n_submeshes=1,
                          stage_plans_solved=0, search_s=0.0)
    assert [k for k, v in report.rejected_by_kind().items() if v] == ["planner", "bug"]
    msg = report.no_fit_message()
    assert msg.index("autopp failed while probing") < msg.index("the planner failed"), msg
    assert "please report it; AUTOPP_TRACEBACK=1" in msg, msg


@pytest.mark.compat  # forked probe processes (autopp/_compat/autograd.py)
def test_pp_may_exceed_the_block_count_with_stages_of_only_the_embedding_or_head():
    """A 2-block model on 4 pp ranks: the search prices the split whose first stage holds
    only the embedding and whose last only the head (0-1-1-0), and its exact plan plans
    those stages; more stages than blocks + 2 are refused, with the reason, and so are
    more stages than blocks where pp alone does not exceed them."""
    import autopp
    from tests.harness.models import llama3_meta

    report = autopp.search(llama3_meta(2), world_size=4, global_batch=8, seq_len=16,
                           options=autopp.PlannerOptions(profile="CPU"), pp_sizes=[4],
                           tp_sizes=[1],
                           schedules=("1F1B", "Interleaved1F1B"))
    best = report.best
    assert best.layout.pp == 4 and best.layers_per_stage == (0, 1, 1, 0), best
    assert [list(f) for f in best.fqns_per_stage] == [
        ["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "lm_head"]]
    assert any("8 stages is more than the 4 stages this model can be cut into (2 layers, "
               "and 2 end stage(s)" in why for _, why in report.rejected), report.rejected
    # where pp does not exceed the blocks, every stage holds one (as before)
    two = autopp.search(llama3_meta(2), world_size=2, global_batch=8, seq_len=16,
                        options=autopp.PlannerOptions(profile="CPU"), tp_sizes=[1],
                        schedules=("Interleaved1F1B",))
    assert ("pp2 dp1 tp1 Interleaved1F1B x2", "4 stages is more than the model's 2 layers "
            "(every stage holds one)") in two.rejected, two.rejected
    dry = report.plan(0)
    assert [list(f) for f in dry.plan.fqns_per_stage] == [list(f) for f in best.fqns_per_stage]
    assert dry.step_time_s > 0


def test_split_backward_pricing_holds_what_w_keeps_at_each_peak():
    """The search prices a split backward's stage by its peaks, as the exact planner's row:
    hand-made probe costs (one layer: 10 GiB of activations a microbatch, nothing else),
    ZBVZeroBubble pp2 m4 (stage 0 holds 4 microbatches F->I, or 3 and 1 I->W; stage 1: 3,
    2+1 or 0+2) on 100 GiB (46.8 GiB a stage once the working memory and communicators are
    off). W keeping 30 GiB: stage 0 needs max(40, 30 + 30) = 60 GiB, over, where counting
    the activations alone (4 x 10 = 40) would fit; keeping 5 GiB: max(40, 35) fits. 1F1B
    pp4, whose backward is whole, holds 4 x 10 GiB on stage 0 of its 93.7 GiB (one stage a
    rank), whatever W would keep (4 x 30 would not fit)."""
    import dataclasses

    from torch import nn

    from autopp.estimate.stage_costs import StateBytes
    from autopp.layout_search.layouts import Layout
    from autopp.layout_search.pricing import Pricer
    from autopp.layout_search.unit_costs import ZERO, ShapeCosts, UnitCost
    from autopp.profiles import get_profile
    from autopp.stage_split.layout import ModelLayout

    gib = 2**30
    layout = ModelLayout(pre=(), layers_attr="layers", layer_names=("0", "1", "2", "3"),
                         post=())
    pricer = Pricer(nn.Linear(2, 2), layout, global_batch=16, seq_len=8,
                    profile=get_profile("H100"), mixed_precision=None, usable=100 * gib)
    unit = UnitCost(per_microbatch_s=1e-3, recompute_s=0.0, unshard_s=0.0, reduce_grad_s=0.0,
                    activation_bytes=10 * gib, gathered_bytes=0.0,
                    state=StateBytes(parameters=0, gradients=0, unreduced_gradients=0,
                                     optimizer=0), kept_for_w_bytes=30 * gib)

    def priced(kept: float, schedule: str, pp: int, v: int):
        pricer.shapes.clear()
        pricer.add(ShapeCosts(dp=1, tp=1, rows=4, boundary="batch+seq", pre={"none": ZERO},
                              layer={"none": (dataclasses.replace(unit, kept_for_w_bytes=kept),)},
                              post={"none": ZERO}, loss_s=0.0, hidden_bytes=0.0,
                              planning_s=0.0, solved=0))
        return pricer.split(Layout(pp=pp, dp=1, tp=1, schedule=schedule, stages_per_rank=v,
                                   n_microbatches=4))

    over = priced(30 * gib, "ZBVZeroBubble", 2, 2)
    assert isinstance(over, str) and "needs ~60.0 GiB" in over, over
    assert "what W keeps from I" in over
    fits = priced(5 * gib, "ZBVZeroBubble", 2, 2)
    assert not isinstance(fits, str), fits
    assert fits.costs[0].activation_bytes_kept_for_w == 5 * gib
    assert not isinstance(priced(30 * gib, "1F1B", 4, 1), str)


def test_a_second_round_bound_simulates_least_cheap_bound_first_and_stops_once_it_beats_the_best():
    """Between the search's rounds, a sub-mesh whose unfit layouts cannot beat the best that
    fits is not probed again. Its layouts are simulated (with unlimited memory) only as its
    probe is about to start, least compute bound first, and only until one beats the best:
    worked here by hand with a stand-in pricer."""
    from types import SimpleNamespace

    from autopp.layout_search.search import _UnfitBounds

    cheap = {"a1": 1.0, "a2": 2.0, "a3": 5.0, "b1": 4.0}   # compute bounds (s)
    simulated = {"a1": 3.5, "a2": 2.5, "a3": 6.0, "b1": 4.5}  # steps with unlimited memory
    calls = []

    class Pricer:
        shapes = {"a": None, "b": None}

        def split(self, lay, usable):
            assert usable == float("inf")
            return SimpleNamespace(layout=lay, bound_s=cheap[lay])

        def simulate(self, sp):
            calls.append(sp.layout)
            return SimpleNamespace(step_time_s=simulated[sp.layout])

    priced = {lay: "does not fit: over" for lay in cheap} | {"a0": "a Candidate that fits"}
    families = {"a": ["a0", "a1", "a2", "a3"], "b": ["b1"], "c": ["c1"]}  # c: not probed
    bounds = _UnfitBounds(priced, families, Pricer(), ["a", "b", "c"])
    assert set(bounds.bounds) == {"a", "b"} and calls == []  # nothing simulated yet
    assert bounds.least("a") == 1.0 and bounds.least("b") == 4.0
    # best 3.0: a1 (cheap 1.0) simulates to 3.5, no better; a2 (cheap 2.0) to 2.5: stop
    assert bounds.simulated("a", 3.0) == 2.5 and calls == ["a1", "a2"]
    assert bounds.simulated("a", 3.0) == 2.5 and calls == ["a1", "a2"]  # once per sub-mesh
    # best 3.0 and b1's compute bound 4.0: dominated without a simulation
    assert bounds.simulated("b", 3.0) == 4.0 and calls == ["a1", "a2"]
    assert bounds.bounds["a"] == {"a1": 3.5, "a2": 2.5, "a3": 5.0}


def test_a_probe_whose_microbatches_would_be_empty_is_refused_with_the_sizes():
    """Probing with more reference microbatches than sequences is a sizes error (which the
    search reports as the planner's refusal), not a reshape failure deep in tracing that the
    search would label a bug in autopp."""
    import torch

    from autopp.layout_search.unit_costs import probe_costs

    tokens = torch.empty((8, 64), dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="batch size 8 is not divisible by n_microbatches=16"):
        probe_costs(None, None, None, tokens=tokens, n_microbatches=16, profile="H100",
                    boundary="batch", loss_kind="batch", modes=("none",))
    with pytest.raises(ValueError, match="batch size 8 is not divisible by n_microbatches=3"):
        probe_costs(None, None, None, tokens=tokens, n_microbatches=3, profile="H100",
                    boundary="batch", loss_kind="batch", modes=("none",))


def test_a_stage_gathers_block_by_block_when_only_that_fits():
    """Each stage of a priced layout holds its weights the fastest way that fits: hand-made
    probe costs, pp1 x dp8, four layers of 1 GiB parameter shards, 10 GiB gathered weights,
    10 GiB gradients before their once-per-step reduction (1 GiB after), 2 GiB AdamW state
    and 2 GiB of activations. Gathered once per step the stage needs 4 + 40 + 8 + 40 + 8 =
    100 GiB, over the ~93 GiB it has of 100; block by block 4 + 4 + 8 + 2 x 10 + 8 = 44 GiB
    fits, and its F (a third of 4 x 30 ms) pays the gathers (16 ms a block) beside the
    compute: the first block's in full, of the other 48 ms what the first three blocks' 30 ms
    of F leave (18 ms). With memory to spare, once per step is faster and chosen."""
    from torch import nn

    from autopp.estimate.stage_costs import StateBytes
    from autopp.layout_search.layouts import Layout
    from autopp.layout_search.pricing import Pricer
    from autopp.layout_search.unit_costs import ZERO, ShapeCosts, UnitCost
    from autopp.profiles import get_profile
    from autopp.stage_split.layout import ModelLayout

    gib, ms = 2**30, 1e-3
    layout = ModelLayout(pre=(), layers_attr="layers", layer_names=("0", "1", "2", "3"),
                         post=())
    unit = UnitCost(per_microbatch_s=30 * ms, recompute_s=0.0, unshard_s=16 * ms,
                    reduce_grad_s=8 * ms, activation_bytes=2 * gib, gathered_bytes=10 * gib,
                    state=StateBytes(parameters=gib, gradients=gib, unreduced_gradients=10 * gib,
                                     optimizer=2 * gib))
    lay = Layout(pp=1, dp=8, tp=1, schedule="1F1B", stages_per_rank=1, n_microbatches=1)

    def split(usable: float, per_block: bool = True):
        pricer = Pricer(nn.Linear(2, 2), layout, global_batch=16, seq_len=8,
                        profile=get_profile("H100"), mixed_precision=None, usable=usable,
                        per_block=per_block)
        pricer.add(ShapeCosts(dp=8, tp=1, rows=16, boundary="batch+seq", pre={"none": ZERO},
                              layer={"none": (unit,)}, post={"none": ZERO}, loss_s=0.0,
                              hidden_bytes=0.0, planning_s=0.0, solved=0))
        return pricer, pricer.split(lay)

    _, once_only = split(100 * gib, per_block=False)
    assert isinstance(once_only, str) and "needs ~100.0 GiB" in once_only, once_only
    pricer, sp = split(100 * gib)
    assert not isinstance(sp, str), sp
    assert sp.weight_gathering == ("per_block",)
    cost = sp.costs[0]
    assert cost.gathered_param_bytes == 20 * gib
    assert cost.unreduced_grad_bytes == cost.grad_bytes == 4 * gib
    assert cost.forward_s == pytest.approx(40 * ms + 16 * ms + 18 * ms)
    assert (cost.unshard_s, cost.reduce_grad_s) == (0.0, 0.0)
    candidate = pricer.simulate(sp)
    assert not isinstance(candidate, str), candidate
    assert candidate.weight_gathering == ("per_block",)
    assert max(candidate.peak_bytes) < 50 * gib
    _, roomy = split(1000 * gib)
    assert roomy.weight_gathering == ("once_per_step",)
    assert roomy.costs[0].gathered_param_bytes == 40 * gib
