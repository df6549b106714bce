"""Stage-boundary and loss placements chosen by cost (no processes; fake process group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopp import build_world_mesh, cross_entropy, init_fake_world, stage_sub_mesh
from autopp.plan.boundaries import choose_boundaries
from autopp.plan.make import describe_loss, loss_kinds
from autopp.sharding.cost.loss import cross_entropy_time_s


def test_boundary_dp_is_exact_on_a_small_chain():
    # stage 1 is much cheaper when its input is "b" and its output "a"; sending "b" costs 1
    table = {
        (0, "batch", "a"): 5.0, (0, "batch", "b"): 5.5,
        (1, "a", "a"): 9.0, (1, "a", "b"): 9.0, (1, "b", "a"): 2.0, (1, "b", "b"): 8.0,
        (2, "a", "batch"): 1.0, (2, "b", "batch"): 4.0, (2, "a", "vocab"): 0.5,
        (2, "b", "vocab"): 3.0,
    }
    send = {"a": 0.1, "b": 1.0}
    bounds = choose_boundaries(
        3, ("a", "b"), lambda s, i, o: table[s, i, o], lambda s, k: send[k],
        last_kinds=("batch", "vocab"),
    )
    assert bounds == ["batch", "b", "a", "vocab"]  # 5.5 + 1 + 2 + 0.1 + 0.5 = 9.1
    # only "batch" allowed at the end
    assert choose_boundaries(
        3, ("a", "b"), lambda s, i, o: table[s, i, o], lambda s, k: send[k]
    )[-1] == "batch"


def test_boundaries_minimise_alpas_objective_not_the_sum():
    # two stages: the cheapest sum loads stage 0 heavily; with many microbatches the
    # slowest stage dominates, so the balanced choice wins
    table = {(0, "batch", "x"): 1.0, (0, "batch", "y"): 3.0,
             (1, "x", "batch"): 5.0, (1, "y", "batch"): 3.1}
    args = (2, ("x", "y"), lambda s, i, o: table[s, i, o], lambda s, k: 0.0)
    assert choose_boundaries(*args, n_microbatches=1) == ["batch", "x", "batch"]  # 6 < 6.1
    # M = 8: x gives 6 + 7 * 5 = 41; y gives 6.1 + 7 * 3.1 = 27.8
    assert choose_boundaries(*args, n_microbatches=8) == ["batch", "y", "batch"]
    # both stages on one rank (rank_of): the max is over the rank's sum, 6 vs 6.1
    assert choose_boundaries(*args, n_microbatches=8, rank_of=[0, 0]) == ["batch", "x", "batch"]


def test_boundaries_exact_with_two_stages_per_rank():
    # stages 0 and 2 share rank 0 (a loop placement). Boundary kind k after stages 0 and 1:
    #   x: stage times 1, 1, 5  (sum 7,   rank 0: 6)   -> 7   + 7 * 6   = 49
    #   y: stage times 3, 2, 2.5 (sum 7.5, rank 0: 5.5) -> 7.5 + 7 * 5.5 = 46
    #   z: stage times 5, 4, 0.2 (sum 9.2, rank 0: 5.2) -> 9.2 + 7 * 5.2 = 45.6  (best)
    # mixing kinds makes stage 1 slow. Capping single stage times never proposes z (its
    # slowest stage, 5, also admits x, whose sum is lower); scoring every assignment does.
    s0, s1, s2 = {"x": 1.0, "y": 3.0, "z": 5.0}, {"x": 1.0, "y": 2.0, "z": 4.0}, \
        {"x": 5.0, "y": 2.5, "z": 0.2}

    def t(s, a, b):
        return s0[b] if s == 0 else (s1[a] if a == b else 100.0) if s == 1 else s2[a]

    args = (3, ("x", "y", "z"), t, lambda s, k: 0.0)
    assert choose_boundaries(*args, n_microbatches=8, rank_of=[0, 1, 0]) == \
        ["batch", "z", "z", "batch"]


def test_infeasible_boundary_is_skipped():
    inf = float("inf")
    table = {(0, "batch", "x"): 2.0, (0, "batch", "y"): inf,
             (1, "x", "batch"): 2.0, (1, "y", "batch"): 0.1}
    args = (2, ("x", "y"), lambda s, i, o: table[s, i, o], lambda s, k: 0.0)
    for m in (1, 8):
        assert choose_boundaries(*args, n_microbatches=m) == ["batch", "x", "batch"]


def test_loss_parallel_is_cheaper_for_a_large_vocabulary_on_h100():
    logits = torch.empty(8, 2048, 128256, device="meta")  # llama3-8B's vocabulary
    args = ((8, 8), ("dp", "tp"), "H100")
    par = cross_entropy_time_s(logits, *args, parallel=True)
    full = cross_entropy_time_s(logits, *args, parallel=False)
    assert par < full / 4  # 1/tp of the memory traffic plus three small all-reduces


def test_loss_kinds():
    init_fake_world(8)
    try:
        sub = stage_sub_mesh(build_world_mesh(pp=2, dp=2, tp=2))
        assert loss_kinds(sub, cross_entropy, None) == ("batch", "vocab")
        assert loss_kinds(sub, cross_entropy, True) == ("vocab",)
        assert loss_kinds(sub, cross_entropy, False) == ("batch",)
        assert loss_kinds(sub, lambda o, t: o.sum(), None) == ("batch",)
        with pytest.raises(ValueError, match="needs loss_fn=autopp.cross_entropy and tp > 1"):
            loss_kinds(sub, lambda o, t: o.sum(), True)
    finally:
        dist.destroy_process_group()
    assert "loss parallel" in describe_loss("vocab")
    assert "gathered" in describe_loss("batch")
