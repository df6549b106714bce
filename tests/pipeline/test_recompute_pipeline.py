"""Planned pipelines with activation recomputation (``PlannerOptions(recompute=...)``): after
one step the loss and every gradient equal the single-process model's (fp32, 1e-5) with
"selective" and "full" recomputation, under 1F1B and ZBVZeroBubble (whose split backward
recomputes in I and hands W what it needs), on tp- and dp-sharded stages; and each stage
keeps less per microbatch than without recomputation ("full" least). One launch. Also, in
one process: the option's validation, and the graph-replay memory count the memory benchmark
(``benchmarks/memory.py``) predicts actions' working memory with."""

from __future__ import annotations


import pytest

from tests.harness.parity import assert_w_after_i
from tests.harness.launch import run_on_ranks
from tests.harness.models import llama3_meta, make_batch
from tests.harness.reference import reference_run
from tests.harness.workers.pipeline import run_configs
from tests.harness.checks import BATCH, N_LAYERS, SEQ, check_step, llama3_case

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


@pytest.fixture(scope="module")
def reference():
    tokens, target = make_batch(BATCH, SEQ)
    return reference_run(llama3_meta(N_LAYERS), [(tokens, target)])


def _planned(schedule, recompute, *, dp, tp, **options):
    return llama3_case(schedule, 2, dp=dp, tp=tp, saved_bytes=True,
                planner_options=dict(recompute=recompute, **options))


def unshard_waits(log: list[tuple[str, int, int | None]]) -> dict[int, str]:
    """Per stage whose UNSHARD left gathers in flight: where the runtime waited for them."""
    out = {}
    for k, (kind, stage, _) in enumerate(log):
        if kind != "UNSHARD wait":
            continue
        unshard = max(j for j in range(k) if log[j][:2] == ("UNSHARD", stage))
        between = [a for a in log[unshard + 1:k] if a[1] == stage]
        after = log[k + 1] if k + 1 < len(log) else None
        out[stage] = ("before its first action" if not between and after is not None
                      and after[1] == stage and after[0] != "UNSHARD wait" else
                      f"after {between}, before {after}")
    return out


def test_planner_options_recompute_is_validated():
    from autopp.backends import PlannerOptions

    assert PlannerOptions().recompute == "auto"
    assert PlannerOptions(recompute="full").recompute == "full"
    with pytest.raises(ValueError, match="'none', 'selective', 'full'"):
        PlannerOptions(recompute="everything")


def test_graph_peak_bytes_replays_allocations_and_frees():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopp.lower.memory import graph_peak_bytes

    def f(x):  # x: 400 bytes, never counted (the caller holds it)
        a = x * 2           # +400
        b = a.view(-1)      # a view: nothing new
        c = b + 1           # +400 (a is freed after this: 800 at most so far)
        c.mul_(3)           # in place: nothing new
        d, e = c.sin().split(50)  # +400, c freed after
        return d * 2        # +200 while sin's 400 is held: 600 at most here

    assert graph_peak_bytes(make_fx(f)(torch.randn(10, 10))) == 800


@pytest.mark.multiprocess
def test_recompute_selective_and_full_match_single_process(reference):
    # tp with sequence-parallel stage boundaries: the forward's reductions are saved, never
    # re-run; its all-gathers of activations are gathered again in the backward
    configs = [_planned(s, r, dp=1, tp=2, boundary="batch+seq")
               for s in ("1F1B", "ZBVZeroBubble") for r in ("selective", "full")]
    configs.append(_planned("Interleaved1F1B", "selective", dp=1, tp=2))  # 2 stages a rank
    # dp with weights sharded over it (a parameter-only budget forces it; ZBV's two stages
    # per rank share theirs): the gathers stay in UNSHARD
    configs += [_planned("1F1B", "full", dp=2, tp=1, parameter_budget_bytes=7e6),
                _planned("ZBVZeroBubble", "selective", dp=2, tp=1, parameter_budget_bytes=7e6)]
    for cfg in configs[-2:]:
        cfg.count_collectives = True
    results = run_on_ranks(run_configs, 4, configs)
    check_step(results, configs, reference)
    for i, cfg in enumerate(configs):
        mode = cfg.planner_options["recompute"]
        for r in results:
            res = r[i]
            assert set(res["recompute"]) == {mode}, (cfg, res["recompute"])
            assert all(a < b for a, b in zip(res["saved_bytes"], res["saved_bytes_none"])), (
                cfg, res["saved_bytes"], res["saved_bytes_none"])
            if cfg.count_collectives:  # weights gathered at UNSHARD only
                assert not [k for k in res["collectives"]
                            if "params" in k and not k.startswith("UNSHARD")], res["collectives"]
            if cfg.schedule == "ZBVZeroBubble":  # W really deferred, under recomputation
                assert res["deferred_w"] >= 4, (cfg, res["actions"])
                assert_w_after_i(res["action_log"], what=f"{cfg.schedule} {mode}")
        if cfg.count_collectives:  # the budget made some weights dp-sharded
            assert any(r[i]["unshard_gathers"] > 0 for r in results), (
                cfg, [r[i]["unshard_gathers"] for r in results])
            # and their gathers were left in flight by UNSHARD, waited for just before the
            # stage's first action (after the other local stage's UNSHARD, at least)
            waits = [unshard_waits(r[i]["action_log"]) for r in results]
            assert any(waits), (cfg, [r[i]["action_log"][:8] for r in results])
            assert "left in flight to the stage's next action" in results[0][i]["describe"]
            assert all(w == "before its first action" for ws in waits for w in ws.values()), (
                cfg, waits)
            # the gradient reductions too, waited once the schedule's actions are done
            ends = [r[i]["action_log"] for r in results]
            assert any(a[0] == "REDUCE_GRAD wait" for log in ends for a in log), cfg
            assert all(a[0] == "REDUCE_GRAD wait" for log in ends
                       for a in log[next((k for k, a in enumerate(log)
                                          if a[0] == "REDUCE_GRAD wait"), len(log)):]), cfg
    # "full" keeps less than "selective" for the same stage
    by = {(c.schedule, c.planner_options["recompute"]): i for i, c in enumerate(configs)
          if c.tp == 2}
    for s in ("1F1B", "ZBVZeroBubble"):
        for r in results:
            assert all(f < sel for f, sel in zip(r[by[s, "full"]]["saved_bytes"],
                                                 r[by[s, "selective"]]["saved_bytes"])), s
