"""Link models fitted to timings: latency per step and bandwidth from collectives and
send/recv timed at several sizes (:func:`fit_latency_bandwidth`, on the cost model's steps
and wire bytes, :mod:`autopp.profiles.collectives`), and a measured profile's link fields
(:func:`fitted_links`: measured where one host can, from a built-in profile where it
cannot). :mod:`autopp.profiles.measure` does the timing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autopp.profiles import collectives
from autopp.profiles.devices import DeviceProfile


@dataclass(frozen=True, slots=True)
class LinkFit:
    """``seconds ≈ latency_s · steps + bytes / bandwidth`` fitted to timings."""

    latency_s: float
    """Seconds per latency-bound step, independent of the size (>= 0): per send for
    point-to-point, per ring step for collectives (:mod:`autopp.profiles.collectives`)."""
    bandwidth: float
    """Bytes per second."""
    rel_rms: float
    """Root mean square of the relative residuals (fit - measured) / measured."""


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float], *,
                          relative: bool = True,
                          steps: Sequence[float] | None = None) -> LinkFit:
    """Least-squares fit of ``seconds = latency · steps + nbytes / bandwidth``.

    Args:
        nbytes: bytes moved by each timed operation (wire bytes for collectives); at least
            two distinct values.
        seconds: the measured time of each operation.
        relative: minimise relative errors (weights ``1 / seconds**2``), so small messages (the
            latency) count as much as large ones (the bandwidth); False: plain least squares.
        steps: latency-bound steps of each operation (a collective's ring steps); None: one.

    A negative fitted latency is clamped to 0 and the bandwidth refitted through the origin.
    Raises ValueError when the times do not grow with the bytes."""
    xs, ts = [float(x) for x in nbytes], [float(t) for t in seconds]
    ss = [1.0] * len(xs) if steps is None else [float(k) for k in steps]
    if not len(xs) == len(ts) == len(ss):
        raise ValueError(f"{len(xs)} byte counts, {len(ts)} timings and {len(ss)} step "
                         "counts: pass one of each per point")
    if len(set(xs)) < 2:
        raise ValueError("fitting latency and bandwidth needs timings at >= 2 message sizes")
    if not all(t > 0 and math.isfinite(t) for t in ts):
        raise ValueError(f"timings must be positive and finite, got {ts}")
    ws = [1 / t**2 if relative else 1.0 for t in ts]
    # normal equations of t = a·s + b·x (with s = 1: the usual line through an intercept)
    a_ss = sum(w * k * k for w, k in zip(ws, ss))
    a_sx = sum(w * k * x for w, k, x in zip(ws, ss, xs))
    a_xx = sum(w * x * x for w, x in zip(ws, xs))
    b_s = sum(w * k * t for w, k, t in zip(ws, ss, ts))
    b_x = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = a_ss * a_xx - a_sx * a_sx
    if not det > 1e-12 * a_ss * a_xx:
        raise ValueError("fitting latency and bandwidth needs timings at >= 2 message sizes "
                         "not in proportion to their steps")
    latency = (a_xx * b_s - a_sx * b_x) / det
    slope = (a_ss * b_x - a_sx * b_s) / det
    if latency < 0:
        latency, slope = 0.0, b_x / a_xx
    if not slope > 0:
        raise ValueError(
            f"timings {ts} do not grow with the bytes {xs}: no bandwidth can be fitted; "
            "measure larger messages or more repeats"
        )
    rel = [(latency * k + slope * x - t) / t for k, x, t in zip(ss, xs, ts)]
    return LinkFit(latency, 1 / slope, math.sqrt(sum(r * r for r in rel) / len(rel)))


KIND_OF = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
           "all_gather_into_tensor": "all_gather"}
"""The cost model's name (:mod:`autopp.profiles.collectives`) of each collective timed."""


def _kind(collective: str) -> str:
    if collective not in KIND_OF:
        raise ValueError(f"no wire-bytes rule for collective {collective!r}; one of "
                         f"{sorted(KIND_OF)}")
    return KIND_OF[collective]


def wire_bytes(collective: str, local_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for ``collective`` on a ``local_bytes`` input, as the cost model
    counts them (:func:`autopp.profiles.collectives.wire_bytes`)."""
    return collectives.wire_bytes(_kind(collective), world_size, local_bytes)


def ring_steps(collective: str, world_size: int) -> int:
    """Latency-bound steps of ``collective`` over ``world_size`` ranks, as the cost model
    counts them (:func:`autopp.profiles.collectives.collective_steps`)."""
    return collectives.collective_steps(_kind(collective), world_size)


def fitted_links(raw: dict[str, Any], world_size: int, base: DeviceProfile | None,
                 collectives_run: Sequence[str]
                 ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The profile's link fields from :func:`autopp.profiles.measure.measure_profile`'s raw
    timings ``raw``: measured where this host can (the intra-node link and send/recv, with
    two ranks or more), from ``base`` where it cannot; the fits' details; and what was not
    measured, each with where its value comes from. ``collectives_run``: the collectives
    timed (for the error when the backend ran none)."""
    if world_size == 1:
        if base is None:
            raise ValueError("one rank measures no link and no profile was given to take "
                             "them from (links_from=)")
        fields = {f: getattr(base, f) for f in (
            "intra_node_bw", "inter_node_bw", "intra_node_latency", "inter_node_latency",
            "p2p_bw", "p2p_latency", "devices_per_node")}
        return fields, {}, [f"collectives, send/recv and devices per node (one rank): "
                            f"{base.name!r}'s"]
    coll = raw["collectives"]
    if not coll["points"]:
        raise RuntimeError(f"backend ran none of {tuple(collectives_run)}: {coll['unsupported']}; "
                           "pass another backend")
    xs, ts, ks = [], [], []
    for op, points in coll["points"].items():
        for nbytes, t in points:
            xs.append(wire_bytes(op, nbytes, world_size))
            ts.append(t)
            ks.append(ring_steps(op, world_size))
    coll_fit = fit_latency_bandwidth(xs, ts, steps=ks)
    per_op = {op: asdict(fit_latency_bandwidth(
        [wire_bytes(op, b, world_size) for b, _ in pts], [t for _, t in pts],
        steps=[ring_steps(op, world_size)] * len(pts)))
        for op, pts in coll["points"].items()}
    p2p_fit = fit_latency_bandwidth([b for b, _ in raw["p2p"]], [t for _, t in raw["p2p"]])
    if base is not None:
        inter, inter_lat = base.inter_node_bw, base.inter_node_latency
        source = f"{base.name!r}'s"
    else:
        inter, inter_lat = coll_fit.bandwidth, coll_fit.latency_s
        source = "the measured intra-node link's (no built-in profile for this device)"
    fields = dict(intra_node_bw=coll_fit.bandwidth, inter_node_bw=inter,
                  intra_node_latency=coll_fit.latency_s, inter_node_latency=inter_lat,
                  p2p_bw=p2p_fit.bandwidth, p2p_latency=p2p_fit.latency_s,
                  devices_per_node=world_size)
    fits = {"collective_fit": asdict(coll_fit), "collective_fit_by_op": per_op,
            "p2p_fit": asdict(p2p_fit)}
    return fields, fits, [f"inter-node link (one host): {source}"]
