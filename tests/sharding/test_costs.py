import pytest
import torch

from autopp._compat import sharding as compat
from autopp.sharding.costs import CostModel
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
    prof = get_profile("H100")
    cm = CostModel(prof, (4, 2))
    shape, dt = (1024, 1024), torch.float32
    full = 1024 * 1024 * 4
    bw, lat = cm.links.bandwidth, cm.links.latency
    t, (c,) = cm.redistribute((S0, R), (R, R), shape, dt)
    assert c.kind == "all_gather" and c.mesh_dim == 0
    assert t == pytest.approx(lat[0] + 3 * (full / 4) / bw[0])
    t, (c,) = cm.redistribute((P, R), (R, R), shape, dt)
    assert c.kind == "all_reduce" and t == pytest.approx(lat[0] + 2 * 3 / 4 * full / bw[0])
    t, (c,) = cm.redistribute((P, R), (S0, R), shape, dt)
    assert c.kind == "reduce_scatter" and t == pytest.approx(lat[0] + 3 / 4 * full / bw[0])
    t, (c,) = cm.redistribute((R, S0), (R, S1), shape, dt)
    assert c.kind == "all_to_all" and c.mesh_dim == 1
    assert cm.redistribute((R, R), (S0, S1), shape, dt) == (0.0, ())  # local slice


def test_mm_compute_time_splits_with_sharding(make_mesh):
    from torch import nn

    from autopp.sharding.strategies import enumerate_strategies
    from autopp.sharding.trace import trace_joint

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


def test_a_failing_flop_formula_is_logged_and_noted(make_mesh, monkeypatch, caplog):
    """An op whose FLOP formula raises is priced by memory traffic only, and says so: a
    warning when priced, a note in the stage plan, a line in the pipeline plan's text."""
    from torch import nn
    from torch.utils.flop_counter import flop_registry

    from autopp.sharding import plan_stage

    def boom(*args, **kwargs):
        raise RuntimeError("no formula for these shapes")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, boom)
    with torch.device("meta"):
        lin = nn.Linear(256, 256, bias=False)
    with caplog.at_level("WARNING", logger="autopp.sharding.costs"):
        plan = plan_stage(lin, (torch.empty(64, 256, device="meta"),), make_mesh(2, 2),
                          profile="H100", reuse_blocks=False)
    assert "FLOP formula of aten.mm.default failed" in caplog.text
    assert any(n.startswith("FLOP formula of aten.mm.default failed (RuntimeError: no formula")
               for n in plan.notes), plan.notes
