"""The measured device profile: the latency/bandwidth fit, the profile cache and name
resolution, and one real (small) measurement."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from autopp.plan.objective import pp_link
from autopp._compat import sharding as compat
from autopp.profiles import measure, devices as profiles
from autopp.sharding.cost.model import CostModel
from autopp.profiles.link_fit import fit_latency_bandwidth, ring_steps, wire_bytes
from autopp.profiles.measure import measure_profile, measured_name
from autopp.profiles.devices import (
    DeviceProfile,
    load_profile,
    mesh_links,
    profile_cache_dir,
    register_profile,
    save_profile,
)
from autopp.profiles.lookup import get_profile


@pytest.fixture
def profile_cache(tmp_path, monkeypatch):
    """An empty profile cache directory and an empty in-process registry."""
    monkeypatch.setenv("AUTOPP_PROFILE_CACHE", str(tmp_path / "profiles"))
    monkeypatch.setattr(profiles, "_REGISTERED", {})
    return tmp_path / "profiles"


def _profile(name: str, **changes) -> DeviceProfile:
    fields = dict(name=name, flops_bf16=2e11, flops_fp32=5e10, mem_bw=1.5e10,
                  memory_bytes=3e9, compute_efficiency=1.0, devices_per_node=8,
                  intra_node_bw=3e8, inter_node_bw=3e8, intra_node_latency=2e-3,
                  inter_node_latency=2e-3, p2p_bw=2.5e9, p2p_latency=4e-4)
    return DeviceProfile(**{**fields, **changes})


# -- the fit ---------------------------------------------------------------------------------


def test_fit_recovers_exact_latency_and_bandwidth():
    lat, bw = 50e-6, 2e9
    xs = [64 * 1024, 256 * 1024, 1 << 20, 4 << 20, 16 << 20]
    ts = [lat + x / bw for x in xs]
    for relative in (True, False):
        fit = fit_latency_bandwidth(xs, ts, relative=relative)
        assert fit.latency_s == pytest.approx(lat, rel=1e-9)
        assert fit.bandwidth == pytest.approx(bw, rel=1e-9)
        assert fit.rel_rms == pytest.approx(0, abs=1e-9)


def test_fit_ordinary_least_squares_by_hand():
    # (0, 1), (1, 2), (2, 4): mean x 1, mean t 7/3; slope = (4/3 + 5/3) / 2 = 3/2,
    # intercept = 7/3 - 3/2 = 5/6; bandwidth = 1 / slope = 2/3.
    fit = fit_latency_bandwidth([0, 1, 2], [1, 2, 4], relative=False)
    assert fit.latency_s == pytest.approx(5 / 6)
    assert fit.bandwidth == pytest.approx(2 / 3)
    # residuals (fit - t) / t: (5/6-1)/1, (7/3-2)/2, (23/6-4)/4 = -1/6, 1/6, -1/24
    assert fit.rel_rms == pytest.approx(math.sqrt((1 / 36 + 1 / 36 + 1 / 576) / 3))


def test_fit_clamps_negative_latency():
    # OLS on (1, .5), (2, 2), (3, 3.5): slope 3/2, intercept -1 < 0 -> through the origin:
    # slope = sum(x t) / sum(x x) = (0.5 + 4 + 10.5) / 14 = 15/14.
    fit = fit_latency_bandwidth([1, 2, 3], [0.5, 2, 3.5], relative=False)
    assert fit.latency_s == 0.0
    assert fit.bandwidth == pytest.approx(14 / 15)


def test_fit_rejects_what_cannot_be_fitted():
    with pytest.raises(ValueError, match=">= 2 message sizes"):
        fit_latency_bandwidth([8, 8], [1.0, 1.1])
    with pytest.raises(ValueError, match="do not grow"):
        fit_latency_bandwidth([1, 2, 3], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="positive and finite"):
        fit_latency_bandwidth([1, 2], [0.0, 1.0])


def test_fit_with_ring_steps_recovers_the_latency_per_step():
    """Collectives of 8 ranks: all-reduce 14 steps, the others 7; times made with 30 us a
    step and 2 GB/s give those figures back."""
    lat, bw = 30e-6, 2e9
    xs = [1e5, 1e6, 1e7] * 2
    ks = [14] * 3 + [7] * 3
    ts = [lat * k + x / bw for k, x in zip(ks, xs)]
    fit = fit_latency_bandwidth(xs, ts, steps=ks)
    assert fit.latency_s == pytest.approx(lat, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bw, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_wire_bytes_are_the_cost_models(n):
    """The fit's wire bytes and steps are those the cost model prices."""
    prof = _profile("measured-wire")
    cm = CostModel(prof, (n,))
    shape, dt = (64, 1024), torch.float32
    full = 64 * 1024 * 4
    R, S0, P = compat.Replicate(), compat.Shard(0), compat.Partial()
    lat, bw = prof.intra_node_latency, prof.intra_node_bw
    # all_gather's input is the local shard; reduce_scatter's and all_reduce's the full tensor
    for src, dst, op, local in ((S0, R, "all_gather_into_tensor", full / n),
                                (P, S0, "reduce_scatter_tensor", full),
                                (P, R, "all_reduce", full)):
        t, _ = cm.redistribute((src,), (dst,), shape, dt)
        assert t == pytest.approx(lat * ring_steps(op, n) + wire_bytes(op, local, n) / bw)


# -- names, registry and cache ----------------------------------------------------------------


def test_cache_round_trip_by_name(profile_cache):
    prof = _profile("measured-0123456789ab")
    path = save_profile(prof, details={"seconds": 1.0})
    assert path == profile_cache / "measured-0123456789ab.json"
    assert json.loads(path.read_text())["details"] == {"seconds": 1.0}
    profiles._REGISTERED.clear()  # a fresh process: nothing registered
    got = get_profile("measured-0123456789ab")
    assert got == prof
    assert get_profile("measured-0123456789ab") is got  # registered by the first lookup


def test_unknown_measured_name_says_how_to_fix(profile_cache):
    with pytest.raises(ValueError, match="does not exist.*get_profile\\('measure'\\)"):
        get_profile("measured-ffffffffffff")


def test_file_holding_another_profile_is_refused(profile_cache):
    save_profile(_profile("measured-aaaaaaaaaaaa"), profile_cache / "measured-bbbbbbbbbbbb.json")
    with pytest.raises(ValueError, match="holds profile 'measured-aaaaaaaaaaaa'"):
        get_profile("measured-bbbbbbbbbbbb")


def test_measure_reads_this_machines_cached_profile(profile_cache, monkeypatch):
    """With a stored measurement for this machine nothing is measured, and "measure" names
    the default world size's profile."""
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although a cached profile exists")

    monkeypatch.setattr(measure, "_measure", no_measuring)
    for ws in (2, measure.DEFAULT_WORLD_SIZE):
        name = measured_name(world_size=ws, device="cpu")
        assert name.startswith("measured-") and len(name) == len("measured-") + 12
        save_profile(_profile(name, devices_per_node=ws))
    assert measured_name(world_size=2, device="cpu") != measured_name(world_size=4, device="cpu")
    profiles._REGISTERED.clear()
    two = measure_profile(world_size=2, device="cpu")
    assert two.name == measured_name(world_size=2, device="cpu") and two.devices_per_node == 2
    if not torch.cuda.is_available():  # "measure" measures the default device
        default = get_profile("measure")
        assert default.name == measured_name(device="cpu")
        assert default.devices_per_node == measure.DEFAULT_WORLD_SIZE


def test_register_profile(profile_cache):
    prof = register_profile(_profile("lab-box"))
    assert get_profile("lab-box") is prof
    for reserved in ("H100", "measure"):
        with pytest.raises(ValueError, match="reserved"):
            register_profile(_profile(reserved))
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("lab-box-2")


def test_pp_link_uses_measured_p2p():
    prof = _profile("measured-p2p")
    link = pp_link(prof, (2, 2, 2))
    assert (link.latency_s, link.bandwidth_bytes_per_s) == (prof.p2p_latency, prof.p2p_bw)
    plain = dataclasses.replace(prof, p2p_bw=None, p2p_latency=None)
    link = pp_link(plain, (2, 2, 2))
    links = mesh_links(plain, (2, 2, 2))
    assert (link.latency_s, link.bandwidth_bytes_per_s) == (links.latency[0], links.bandwidth[0])


def test_profile_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOPP_PROFILE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert profile_cache_dir() == tmp_path / ".cache" / "autopp" / "profiles"


# -- a real measurement ---------------------------------------------------------------------


@pytest.mark.multiprocess
def test_measure_two_ranks(profile_cache):
    from tests.harness.launch import context as _context

    _context()  # the harness's forkserver preloads first, should this start the server
    prof = measure_profile(world_size=2, device="cpu")
    assert prof.name == measured_name(world_size=2, device="cpu")
    values = [prof.flops_fp32, prof.flops_bf16, prof.mem_bw, prof.memory_bytes,
              prof.intra_node_bw, prof.inter_node_bw, prof.p2p_bw]
    assert all(math.isfinite(v) and v > 0 for v in values), prof
    for lat in (prof.intra_node_latency, prof.inter_node_latency, prof.p2p_latency):
        assert lat is not None and math.isfinite(lat) and lat >= 0, prof
    assert prof.compute_efficiency == 1.0 and prof.devices_per_node == 2
    stored = json.loads((profile_cache / f"{prof.name}.json").read_text())
    assert set(stored["details"]["raw"]["collectives"]["points"]) == set(measure.COLLECTIVES)
    # one host measures no inter-node link: the device's built-in one, and the file says so
    cpu = profiles.PROFILES["CPU"]
    assert (prof.inter_node_bw, prof.inter_node_latency) == \
        (cpu.inter_node_bw, cpu.inter_node_latency)
    assert prof.intra_node_bw == stored["details"]["collective_fit"]["bandwidth"]
    assert stored["details"]["not_measured"] == ["inter-node link (one host): 'CPU''s"]
    profiles._REGISTERED.clear()  # as another process would: resolved from the file
    assert load_profile(prof.name) == prof == get_profile(prof.name)


@pytest.mark.multiprocess
def test_measure_one_rank_says_which_links_come_from_a_built_in_profile(profile_cache, caplog):
    """One rank (one GPU, or a CPU process) measures its compute and memory rates; its links,
    which one rank cannot measure, are the device's built-in profile's, with a warning and
    the list in the stored file."""
    import logging

    from tests.harness.launch import context as _context

    _context()
    with pytest.raises(ValueError, match="links_from='nope' is no built-in or registered"):
        measure_profile(world_size=1, device="cpu", links_from="nope")
    with caplog.at_level(logging.WARNING, logger="autopp.profiles.measure"):
        prof = measure_profile(world_size=1, device="cpu")
    cpu = profiles.PROFILES["CPU"]
    for field in ("flops_fp32", "flops_bf16", "mem_bw"):  # measured, not the built-in's
        value = getattr(prof, field)
        assert math.isfinite(value) and value > 0 and value != getattr(cpu, field), field
    links = ("intra_node_bw", "inter_node_bw", "intra_node_latency", "inter_node_latency",
             "p2p_bw", "p2p_latency", "devices_per_node")
    assert {f: getattr(prof, f) for f in links} == {f: getattr(cpu, f) for f in links}
    stored = json.loads((profile_cache / f"{prof.name}.json").read_text())
    assert "collectives" not in stored["details"]["raw"]
    assert stored["details"]["not_measured"] == [
        "collectives, send/recv and devices per node (one rank): 'CPU''s"]
    assert "not measured: collectives, send/recv" in caplog.text
    assert prof.name != measured_name(world_size=1, device="cpu", links_from="H100")
