"""The rules every pipeline-level price shares: Alpa's pipeline objective, the bytes a stage
boundary sends, and the point-to-point link between pp ranks (the simulator's). The boundary
choice (:mod:`autopp.plan.make`), the estimates (:mod:`autopp.estimate`), the dry run, the
torchtitan integration and the layout search import them from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autopp.profiles.devices import mesh_links
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


def pp_link(profile: Any, mesh_shape: tuple[int, ...]) -> Link:
    """The point-to-point link between neighbouring pp ranks of a ``(pp, dp, tp)`` mesh: each
    device sends its shard to its counterpart, over the link the profile gives the pp dim
    (inter-node when a pp rank's dp × tp devices fill a node). A profile with a measured
    point-to-point link (``p2p_bw`` / ``p2p_latency`` set) gives those figures instead."""
    prof = get_profile(profile)
    links = mesh_links(prof, tuple(mesh_shape))
    latency = links.latency[0] if prof.p2p_latency is None else prof.p2p_latency
    bandwidth = links.bandwidth[0] if prof.p2p_bw is None else prof.p2p_bw
    return Link(latency_s=latency, bandwidth_bytes_per_s=bandwidth)
