"""The rules every pipeline-level price shares: Alpa's pipeline objective, the bytes a stage
boundary sends, and the point-to-point link between each pair of pp ranks (the simulator's).
The boundary choice (:mod:`autopp.plan.make`), the estimates (:mod:`autopp.estimate`), the
dry run, the torchtitan integration and the layout search import them from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autopp.profiles.lookup import get_profile
from autopp.schedules import Link


def pipeline_objective_s(stage_times: Sequence[float], n_microbatches: int,
                         rank_of: Sequence[int] | None = None, transfers_s: float = 0.0) -> float:
    """Alpa's pipeline objective (one microbatch's times, any schedule):

        Σ_s t_s + transfers + (M − 1) · max over pp ranks of Σ_{s on the rank} t_s

    ``rank_of[s]``: the pp rank of stage ``s`` (default: one stage per rank);
    ``transfers_s``: the boundaries' send time per microbatch, forward and back."""
    ranks = list(rank_of) if rank_of is not None else list(range(len(stage_times)))
    per_rank: dict[int, float] = {}
    for s, t in enumerate(stage_times):
        per_rank[ranks[s]] = per_rank.get(ranks[s], 0.0) + t
    return sum(stage_times) + transfers_s + (n_microbatches - 1) * max(per_rank.values())


def transfer_s(link: Link, nbytes: float) -> float:
    """Seconds to send ``nbytes`` over ``link`` alone (the simulator's model of one send)."""
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


def boundary_split(dp: int, tp: int, kind: str) -> int:
    """Devices a dp-global boundary activation is split over in placement ``kind``: the batch
    over dp, and with "batch+seq" the sequence over tp as well."""
    return dp * (tp if kind == "batch+seq" else 1)


def boundary_bytes(t: torch.Tensor, dp: int, tp: int = 1, kind: str = "batch") -> int:
    """Bytes of a dp-global boundary activation held (and sent) by one device in ``kind``."""
    return t.numel() // boundary_split(dp, tp, kind) * t.element_size()


def pp_ranks_share_node(mesh_shape: tuple[int, ...], devices_per_node: int, src: int,
                        dst: int) -> bool:
    """Whether every device of pp rank ``src`` of a row-major ``(pp, dp, tp)`` mesh shares
    a node with its counterpart in pp rank ``dst``: global rank ``r = src · dp·tp + j`` sends
    to ``dst · dp·tp + j``, and the two share a node iff ``r // devices_per_node`` is the
    other's. The pp ranks' devices send in parallel, so one pair across nodes is enough to
    make the pp link inter-node. All pairs share a node iff no node starts between the
    lower rank's first device and the higher rank's last one."""
    group = math.prod(mesh_shape[1:])
    lo, hi = min(src, dst), max(src, dst)
    return lo * group // devices_per_node == (hi * group + group - 1) // devices_per_node


def pp_link(profile: Any, mesh_shape: tuple[int, ...], src: int = 0,
            dst: int | None = None) -> Link:
    """The point-to-point link from pp rank ``src`` to pp rank ``dst`` (default the next one)
    of a row-major ``(pp, dp, tp)`` mesh: each device sends its shard to its counterpart,
    over the profile's intra-node link when every such pair shares a node
    (:func:`pp_ranks_share_node`), else over its inter-node link. A profile with a measured
    point-to-point link (``p2p_bw`` / ``p2p_latency`` set) gives those figures instead."""
    prof = get_profile(profile)
    dst = src + 1 if dst is None else dst
    intra = pp_ranks_share_node(tuple(mesh_shape), prof.devices_per_node, src, dst)
    latency = prof.p2p_latency if prof.p2p_latency is not None else (
        prof.intra_node_latency if intra else prof.inter_node_latency)
    bandwidth = prof.p2p_bw if prof.p2p_bw is not None else (
        prof.intra_node_bw if intra else prof.inter_node_bw)
    return Link(latency_s=latency, bandwidth_bytes_per_s=bandwidth)


def pp_links(profile: Any, mesh_shape: tuple[int, ...],
             stage_ranks: Sequence[int] | None = None) -> dict[tuple[int, int], Link]:
    """:func:`pp_link` for each directed pair of pp ranks that consecutive stages join
    (``stage_ranks[s]``: stage ``s``'s pp rank; None: every pair), both ways: the
    simulator's ``links``. A schedule's sends, a V's turn and a loop's wrap-around
    included, each go over the link between the ranks they really join."""
    pp = mesh_shape[0]
    if stage_ranks is None:
        pairs = {(a, b) for a in range(pp) for b in range(pp) if a != b}
    else:
        ranks = list(stage_ranks)
        pairs = {p for a, b in zip(ranks, ranks[1:]) if a != b for p in ((a, b), (b, a))}
    return {(a, b): pp_link(profile, mesh_shape, a, b) for a, b in sorted(pairs)}


def slowest_link(links: Mapping[tuple[int, int], Link], default: Link) -> Link:
    """The link of ``links`` a transfer takes longest over (lowest bandwidth, then highest
    latency); ``default`` when there is none (one pp rank)."""
    return min(links.values(), key=lambda k: (k.bandwidth_bytes_per_s, -k.latency_s),
               default=default)
