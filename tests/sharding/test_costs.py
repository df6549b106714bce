import pytest
import torch

from autopp._compat import sharding as compat
from autopp.sharding.cost.model import CostModel
from autopp.profiles.devices import PROFILES, mesh_links
from autopp.profiles.lookup import get_profile

R, S0, S1, P = compat.Replicate(), compat.Shard(0), compat.Shard(1), compat.Partial()


def test_profiles_by_name_only():
    assert {"H100", "H200", "A100", "CPU"} <= set(PROFILES)
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("TPUv9")


def test_mesh_links_intra_and_inter_node():
    h100 = get_profile("H100")
    links = mesh_links(h100, (32, 8))  # tp inside a node, dp across nodes
    assert links.bandwidth == (h100.inter_node_bw, h100.intra_node_bw)
    links = mesh_links(h100, (2, 4))  # all 8 in one node
    assert links.bandwidth == (h100.intra_node_bw, h100.intra_node_bw)


def test_collective_formulas():
    """Each step of a ring pays the link's latency: over 4 ranks an all-gather, a
    reduce-scatter and an all-to-all take 3 steps, an all-reduce 6."""
    prof = get_profile("H100")
    cm = CostModel(prof, (4, 2))
    shape, dt = (1024, 1024), torch.float32
    full = 1024 * 1024 * 4
    bw, lat = cm.links.bandwidth, cm.links.latency
    t, (c,) = cm.redistribute((S0, R), (R, R), shape, dt)
    assert c.kind == "all_gather" and c.mesh_dim == 0
    assert t == pytest.approx(3 * lat[0] + 3 * (full / 4) / bw[0])
    t, (c,) = cm.redistribute((P, R), (R, R), shape, dt)
    assert c.kind == "all_reduce" and t == pytest.approx(6 * lat[0] + 2 * 3 / 4 * full / bw[0])
    t, (c,) = cm.redistribute((P, R), (S0, R), shape, dt)
    assert c.kind == "reduce_scatter" and t == pytest.approx(3 * lat[0] + 3 / 4 * full / bw[0])
    t, (c,) = cm.redistribute((R, S0), (R, S1), shape, dt)
    assert c.kind == "all_to_all" and c.mesh_dim == 1  # 2 ranks: 1 exchange step
    assert t == pytest.approx(lat[1] + 1 / 2 * (full / 2) / bw[1])
    assert cm.redistribute((R, R), (S0, S1), shape, dt) == (0.0, ())  # local slice


def test_all_reduce_of_1mb_over_8_ranks_by_hand():
    """H100: 1 MB all-reduced over tp = 8 inside a node is 2·7 = 14 ring steps of 5 us plus
    2·7/8 MB over 450 GB/s; the same over an 8-rank dim across nodes (a (8, 8) mesh's
    first dim spans 64 devices) pays 20 us a step and 50 GB/s."""
    intra = CostModel(get_profile("H100"), (1, 8))
    assert intra.collective_time("all_reduce", 1, 1e6) == pytest.approx(
        14 * 5e-6 + 2 * 7 / 8 * 1e6 / 450e9)
    inter = CostModel(get_profile("H100"), (8, 8))
    assert inter.collective_time("all_reduce", 0, 1e6) == pytest.approx(
        14 * 20e-6 + 2 * 7 / 8 * 1e6 / 50e9)
    # the other collectives over the same intra-node dim: 7 steps each
    assert intra.collective_time("reduce_scatter", 1, 1e6) == pytest.approx(
        7 * 5e-6 + 7 / 8 * 1e6 / 450e9)
    assert intra.collective_time("all_gather", 1, 1e6) == pytest.approx(
        7 * 5e-6 + 7 * 1e6 / 450e9)
    assert intra.collective_time("all_to_all", 1, 1e6) == pytest.approx(
        7 * 5e-6 + 7 / 8 * 1e6 / 450e9)
    assert intra.collective_time("all_reduce", 0, 1e6) == 0.0  # a size-1 dim
    # an all-to-all over both dims of a (2, 4) mesh inside one node: 8 ranks, 7 steps; the
    # bytes that change the first coordinate (1/2 of them) and the second (3/4) each on
    # their link, the slower sets the time
    both = CostModel(get_profile("H100"), (2, 4))
    assert both.collective_time("all_to_all", (0, 1), 1e6) == pytest.approx(
        7 * 5e-6 + 3 / 4 * 1e6 / 450e9)
    from autopp.profiles.collectives import collective_latency_s

    assert collective_latency_s("all_reduce", 8, 5e-6) == pytest.approx(14 * 5e-6)


def test_loss_parallel_all_reduces_pay_their_ring_steps():
    """Loss parallel over tp = 4 (H100, in one node): three all-reduces of one fp32 per
    token, each 2·3 = 6 steps of 5 us plus 2·3/4 of its bytes over 450 GB/s."""
    from autopp.sharding.cost.loss import PASSES, cross_entropy_time_s

    logits = torch.empty(2, 1024, 32000, device="meta")
    t = cross_entropy_time_s(logits, (2, 4), ("dp", "tp"), "H100", parallel=True)
    tokens = 2 * 1024 / 2
    memory = PASSES * tokens * 32000 / 4 * 4 / 3.35e12
    assert t == pytest.approx(memory + 3 * (6 * 5e-6 + 2 * 3 / 4 * tokens * 4 / 450e9))


def test_matmul_rate_follows_the_dtype_and_tf32():
    """fp32 at torch's default precision ("highest") is true fp32: 67 TFLOP/s on an H100,
    19.5 on an A100; TF32 (494 / 156) only when the user allows it; bf16 either way."""
    from autopp.profiles.devices import matmul_peak, tf32_enabled

    h100, a100 = get_profile("H100"), get_profile("A100")
    assert h100.flops(torch.float32) == pytest.approx(67e12 * 0.6)
    assert h100.flops(torch.float32, tf32=True) == pytest.approx(494e12 * 0.6)
    assert a100.flops(torch.float32) == pytest.approx(19.5e12 * 0.6)
    assert a100.flops(torch.float32, tf32=True) == pytest.approx(156e12 * 0.6)
    for tf32 in (False, True):
        assert h100.flops(torch.bfloat16, tf32) == pytest.approx(989e12 * 0.6)
        assert get_profile("CPU").flops(torch.float32, tf32) == pytest.approx(0.2e12 * 0.5)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not tf32_enabled()
        assert matmul_peak(h100, torch.float32, tf32_enabled()) == 67e12
        torch.set_float32_matmul_precision("high")
        assert tf32_enabled()
        assert matmul_peak(h100, torch.float32, tf32_enabled()) == 494e12
        assert matmul_peak(h100, torch.bfloat16, tf32_enabled()) == 989e12
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_older_profile_file_without_tf32_loads(tmp_path):
    """A profile JSON stored before ``flops_tf32`` existed loads, its fp32 rate used for
    TF32 too."""
    import json

    from autopp.profiles import devices

    fields = {f: v for f, v in __import__("dataclasses").asdict(
        devices.with_overrides(PROFILES["CPU"], name="old-box")).items() if f != "flops_tf32"}
    path = tmp_path / "old-box.json"
    path.write_text(json.dumps({"format": 1, "profile": fields, "details": {}}))
    try:
        prof = devices.load_profile(path)
        assert prof.flops_tf32 is None
        assert prof.flops(torch.float32, tf32=True) == prof.flops(torch.float32)
    finally:
        devices._REGISTERED.pop("old-box", None)


def test_mm_compute_time_splits_with_sharding(make_mesh):
    from torch import nn

    from autopp.sharding.options.strategies import enumerate_strategies
    from autopp.tracing.joint import trace_joint

    with torch.device("meta"):
        lin = nn.Linear(1024, 1024, bias=False)
    j = trace_joint(lin, (torch.empty(4096, 1024, device="meta"),))
    st = enumerate_strategies(j, make_mesh(2, 2))
    cm = CostModel(get_profile("H100"), (2, 2))
    mm = next(ns for n, ns in st.nodes.items() if n.target == torch.ops.aten.mm.default)
    assert cm.global_flops(mm) == 2 * 4096 * 1024 * 1024
    times = {o: cm.compute_time(mm, o) for o in mm.options}
    rep = next(o for o in times if all(p == R for p in o.out[0]) and all(
        p == R for pl in o.ins for p in pl))
    split = next(o for o in times if o.out[0] == (S0, S1))
    assert times[split] == pytest.approx(times[rep] / 4)


def test_fp32_matmul_priced_at_fp32_unless_tf32(make_mesh):
    """A compute-bound fp32 mm (4096 x 4096 x 4096) on one H100: its FLOPs over 67 TFLOP/s
    times the efficiency by default, over 494 TFLOP/s with TF32; in bf16 over 989."""
    from torch import nn

    from autopp.sharding.options.strategies import enumerate_strategies
    from autopp.tracing.joint import trace_joint

    flops = 2 * 4096**3
    for dtype, rates in ((torch.float32, (67e12, 494e12)), (torch.bfloat16, (989e12, 989e12))):
        with torch.device("meta"):
            lin = nn.Linear(4096, 4096, bias=False).to(dtype)
        j = trace_joint(lin, (torch.empty(4096, 4096, device="meta", dtype=dtype),))
        st = enumerate_strategies(j, make_mesh(1, 1))
        mm = next(ns for n, ns in st.nodes.items() if n.target == torch.ops.aten.mm.default)
        opt = mm.options[0]
        for tf32, rate in zip((False, True), rates):
            cm = CostModel(get_profile("H100"), (1, 1), tf32=tf32)
            assert cm.global_flops(mm) == flops
            assert cm.compute_time(mm, opt) == pytest.approx(flops / (rate * 0.6)), (dtype, tf32)


@pytest.mark.parametrize("dtype,rate", [(torch.float32, 67e12), (torch.bfloat16, 989e12)])
def test_attention_backward_priced_at_its_own_dtype(make_mesh, dtype, rate):
    """autopp::sdpa_backward runs in q's dtype: an fp32 attention's backward is priced at the
    fp32 rate, a bf16 one's at bf16's (long enough to be compute bound)."""
    import torch.nn.functional as F
    from torch import nn

    import autopp.ops.attention  # noqa: F401  (registers autopp::sdpa)
    from autopp.sharding.options.strategies import enumerate_strategies
    from autopp.tracing.joint import trace_joint

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(128, 128, bias=False)

        def forward(self, x):
            q = self.proj(x)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    with torch.device("meta"):
        m = Attention().to(dtype)
    j = trace_joint(m, (torch.empty(1, 8, 4096, 128, device="meta", dtype=dtype),))
    st = enumerate_strategies(j, make_mesh(1, 1))
    (bwd,) = [ns for n, ns in st.nodes.items()
              if n.target == torch.ops.autopp.sdpa_backward.default]
    cm = CostModel(get_profile("H100"), (1, 1))
    flops = cm.global_flops(bwd)
    assert flops > 0
    assert cm.compute_time(bwd, bwd.options[0]) == pytest.approx(flops / (rate * 0.6))


def test_a_failing_flop_formula_is_logged_and_noted(make_mesh, monkeypatch, caplog):
    """An op whose FLOP formula raises is priced by memory traffic only, and says so: a
    warning when priced, a note in the stage plan, a line in the pipeline plan's text."""
    from torch import nn
    from torch.utils.flop_counter import flop_registry

    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request

    def boom(*args, **kwargs):
        raise RuntimeError("no formula for these shapes")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, boom)
    with torch.device("meta"):
        lin = nn.Linear(256, 256, bias=False)
    with caplog.at_level("WARNING", logger="autopp.sharding.cost.model"):
        plan = plan_stage(stage_request(lin, (torch.empty(64, 256, device="meta"),),
                                        make_mesh(2, 2), profile="H100", reuse_blocks=False))
    assert "FLOP formula of aten.mm.default failed" in caplog.text
    assert any(n.startswith("FLOP formula of aten.mm.default failed (RuntimeError: no formula")
               for n in plan.notes), plan.notes


def test_redistribution_peak_follows_dtensors_own_path(make_mesh):
    """A nested shard (dp and tp both on dim 1) into (R, S(1)): DTensor gathers over tp
    first, so the whole tensor exists on the way (hand-computed: 64 x 128 x 4 bytes); from
    (S(0), S(1)) only dp is gathered and the landed (64, 64) shard is the largest."""
    from autopp._compat.sharding import redistribution_peak_bytes
    from autopp.sharding.plan import from_strs

    mesh = make_mesh(2, 2)
    val = torch.empty(64, 128, device="meta")
    nested = redistribution_peak_bytes(mesh, val, from_strs(("S(1)", "S(1)")), from_strs(("R", "S(1)")))
    assert nested == 64 * 128 * 4
    plain = redistribution_peak_bytes(mesh, val, from_strs(("S(0)", "S(1)")), from_strs(("R", "S(1)")))
    assert plain == 64 * 64 * 4


def test_placement_kind_agrees_with_isinstance():
    """The per-type memo answers what isinstance does, Partial's subclasses included."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    cases = [(R, "replicate"), (S1, "shard"), (P, "partial"), (compat.Partial("avg"), "partial"),
             (_NormPartial(2), "partial"), (compat.StridedShard(0, split_factor=2), "strided")]
    for p, kind in cases:
        assert compat.placement_kind(p) == kind, p
        assert compat.placement_kind(p) == kind, p  # served from the memo


def test_redistribution_prices_shared_only_between_equal_profiles():
    """Cost models share their price table only with profiles of the same numbers: a
    profile registered again under its name with a slower link is priced anew."""
    import dataclasses

    h100 = get_profile("H100")
    slow = dataclasses.replace(h100, intra_node_bw=h100.intra_node_bw / 4)
    shape, dt = (4096, 1024), torch.float32
    t_fast = CostModel(h100, (8,)).redistribute((S0,), (R,), shape, dt)[0]
    assert CostModel(h100, (8,)).redistribute((S0,), (R,), shape, dt)[0] == t_fast
    t_slow = CostModel(slow, (8,)).redistribute((S0,), (R,), shape, dt)[0]
    lat = 7 * mesh_links(h100, (8,)).latency[0]
    assert t_slow - lat == pytest.approx(4 * (t_fast - lat))
