"""The cost model's physics: a llama3-70B block at tp=8, seq 8192, bf16, split into the F, I
and W pieces the schedules run (:func:`autopp.estimate.stage_costs.stage_facts`), costs what
its FLOPs cost. The FLOPs are counted by hand here from the model's dimensions (the cost model
counts them from the traced graph with torch's FLOP counter), on links made free so that
compute alone remains:

* F: the five matmuls (q/k/v, o, w1, w3, w2) and causal attention;
* I: the same matmuls again (each input gradient is one matmul of its forward's size) and
  attention's fused backward (2.5x its forward: five matmuls over the kept pairs, from the
  output and log-sum-exp the forward saved), so I exceeds F by the attention backward, not
  by a factor;
* W: the matmuls once more (each weight gradient is one matmul), no attention (no weight);

with elementwise work (norms, RoPE, SiLU, residuals, casts), memory-bound and priced by bytes,
on top, never below. Under full recomputation the backward-input piece also re-runs the
forward it reads (all of it but the last matmul's output): I grows by about F, W does not
change.
"""

from __future__ import annotations

import pytest
import torch

SEQ, TP = 8192, 8
# llama3 70B: dim, heads, kv heads, head dim, FFN hidden
DIM, HEADS, KV_HEADS, HEAD_DIM, FFN = 8192, 64, 8, 128, 28672


@pytest.fixture(scope="module")
def block_70b():
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs

    from tests.harness.fake_world import BlockStack

    cfg = build_decoder_config_for_backend(llama3_configs["70B"], "sdpa")
    with torch.device("meta"):
        model = cfg.build()
    block = model.layers["0"]
    shapes = [tuple(m.weight.shape) for m in (block.attention.qkv_linear.wqkv,
                                               block.attention.wo, block.feed_forward.w1)]
    assert shapes == [((HEADS + 2 * KV_HEADS) * HEAD_DIM, DIM), (DIM, HEADS * HEAD_DIM),
                      (FFN, DIM)], "not llama3 70B's dimensions"
    return BlockStack(model, 1)


def _phases(block, make_mesh, recompute: str) -> tuple[float, float, float, float]:
    """(F, I, W) seconds of one microbatch of one sequence, and the profile's bf16 rate."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autopp.estimate.stage_costs import stage_facts
    from autopp.profiles.devices import PROFILES, register_profile, with_overrides
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request

    free = register_profile(with_overrides(
        PROFILES["H100"], name="H100-free-links", intra_node_bw=1e30, inter_node_bw=1e30,
        intra_node_latency=0.0, inter_node_latency=0.0))
    mesh = make_mesh(1, TP)
    x = torch.empty(1, SEQ, DIM, device="meta", dtype=torch.bfloat16)  # as bf16 stages pass it
    megatron = {"attention.qkv_linear.wqkv.weight": ("R", "S(0)"),
                "attention.wo.weight": ("R", "S(1)"), "feed_forward.w1.weight": ("R", "S(0)"),
                "feed_forward.w3.weight": ("R", "S(0)"), "feed_forward.w2.weight": ("R", "S(1)")}
    plan = plan_stage(stage_request(block, (x,), mesh, profile=free.name, recompute=recompute,
                                    mixed_precision=MixedPrecisionPolicy(
                                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                                    param_placements={f"layers.0.{k}": v
                                                      for k, v in megatron.items()},
                                    input_placements=("R", "R"), output_placements=("R", "R")))
    facts = stage_facts(block, plan, mesh, (x,), 1, overlap=False)
    return (facts.forward_s, facts.backward_input_s, facts.backward_weight_s,
            free.flops(torch.bfloat16, False))


def test_f_i_w_follow_the_flops_of_what_runs(block_70b, make_mesh):
    matmuls = 2 * SEQ * DIM * ((HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM
                               + 3 * FFN) / TP
    attention = 2 * (HEADS // TP) * (SEQ * (SEQ + 1) // 2) * 2 * HEAD_DIM  # causal q.k, p.v
    f, i, w, rate = _phases(block_70b, make_mesh, "none")
    expect = {"F": (matmuls + attention) / rate, "I": (matmuls + 2.5 * attention) / rate,
              "W": matmuls / rate}
    got = {"F": f, "I": i, "W": w}
    for piece in "FIW":  # elementwise work on top of the FLOPs: at most a quarter more
        assert 1.0 <= got[piece] / expect[piece] <= 1.25, (piece, got, expect)
    # no recomputation: W ~ F within a quarter (the same matmuls; attention and most
    # elementwise work only in F), I / F as their FLOPs are within a quarter (attention's
    # backward adds 1.5 forwards to I; F's elementwise work is larger than I's)
    assert 0.75 <= w / f <= 1.0, (w, f)
    ratio = expect["I"] / expect["F"]
    assert ratio / 1.25 <= i / f <= 1.25 * ratio, (i, f, ratio)
    print(f"70B block, tp={TP}, seq {SEQ}, bf16, per microbatch: F {f * 1e3:.3f} ms, "
          f"I {i * 1e3:.3f} ms, W {w * 1e3:.3f} ms; FLOPs alone: F {expect['F'] * 1e3:.3f}, "
          f"I {expect['I'] * 1e3:.3f}, W {expect['W'] * 1e3:.3f} ms")

    f_full, i_full, w_full, _ = _phases(block_70b, make_mesh, "full")
    assert f_full == pytest.approx(f, rel=1e-6)
    assert w_full == pytest.approx(w, rel=1e-6)
    # the forward re-run in I: all of it the backward reads, so every FLOP but the last
    # matmul's (w2: its backward reads its input, not its output)
    w2 = 2 * SEQ * DIM * FFN / TP
    rerun = (matmuls - w2 + attention) / rate
    assert 1.0 <= (i_full - i) / rerun <= 1.25, (i_full - i, rerun)
    print(f"full recompute: F {f_full * 1e3:.3f} ms, I {i_full * 1e3:.3f} ms, "
          f"W {w_full * 1e3:.3f} ms")
