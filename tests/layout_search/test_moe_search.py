"""``autopp.search`` on a mixture-of-experts model whose layers are of two kinds: each kind
probed and priced at its own cost, and the experts' layout named in the ranking."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


def _heavy_dense_first_layer_model():
    """torchtitan's deepseek_v3 debug model, 4 layers: a dense first layer whose feed-forward
    is widened to 32768 (about five MoE layers' parameters and compute), then 3 MoE layers."""
    import torch
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    cfg = build_decoder_config_for_backend(deepseekv3_configs["debugmodel"], "sdpa",
                                           moe_comm_backend="standard")
    cfg.layers = cfg.layers[:4]
    ff = cfg.layers[0].feed_forward
    ff.w1.out_features = ff.w3.out_features = ff.w2.in_features = 32768
    with torch.device("meta"):
        return cfg.build()


def test_a_heavy_dense_layer_is_priced_as_itself_and_the_split_follows():
    """Priced as one kind (every layer at the first layer's cost, as the search did before
    layers were told apart) the four layers split 2-2; priced each at its own kind's cost,
    the heavy dense layer takes a stage of its own beside the embedding (1-3). All-to-all
    dispatch asked in the options reaches the probes: the MoE stage's experts are split over
    dp with tokens sent by all-to-all, and the report states the imbalance it priced."""
    import autopp

    model = _heavy_dense_first_layer_model()
    report = autopp.search(
        model, world_size=4, global_batch=8, seq_len=64,
        options=autopp.PlannerOptions(profile="H100", token_dispatch="all_to_all",
                                      expert_imbalance=1.5),
        schedules=("1F1B",), pp_sizes=(2,), tp_sizes=(1,), microbatch_choices=1,
        recompute=("none",), workers=1)
    print(report)
    assert report.layer_kinds == (0, 1, 1, 1)
    best = report.best
    assert best.layers_per_stage == (1, 3)
    assert best.experts == ("", "dp a2a")
    assert "dp a2a" in report.table()
    assert "expert_imbalance=1.5" in str(report)
