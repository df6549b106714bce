"""Cost of the cross-entropy loss at the end of the last stage: on gathered logits, or in
parallel over tp with the logits left split on the vocabulary (loss parallel).

The last stage's planned graph ends at the logits, in one of two placements: ``"batch"``
(gathered over tp; the ILP pays the gather, and every tp rank computes the whole loss) or
``"vocab"`` (split on the vocabulary; torch's ``loss_parallel`` reads 1/tp of the logits and
combines with three small all-reduces over tp, one float per token; no backward
communication). This module prices the loss itself for each; the loss is memory bound, reading
and writing the fp32 logits about :data:`PASSES` times."""

from __future__ import annotations

import math

import torch

from autopp.profiles.collectives import collective_s
from autopp.profiles.devices import DeviceProfile, mesh_links
from autopp.profiles.lookup import get_profile

PASSES = 6
"""Reads + writes of the fp32 logits by cross entropy's forward and backward (upcast, max,
sum of exponentials, gradient)."""


def cross_entropy_time_s(
    logits: torch.Tensor,
    mesh_shape: tuple[int, ...],
    dim_names: tuple[str, ...],
    profile: str | DeviceProfile,
    *,
    parallel: bool,
) -> float:
    """Per-device seconds of cross entropy's forward + backward on one microbatch.

    Args:
        logits: meta tensor of the dp-global microbatch's logits (vocabulary last).
        mesh_shape / dim_names: the stage sub-mesh (``("dp", "tp")``).
        parallel: loss parallel (logits split on the vocabulary over tp) or not.
    """
    prof = get_profile(profile)
    sizes = dict(zip(dim_names, mesh_shape))
    dp, tp = sizes.get("dp", 1), sizes.get("tp", 1)
    tokens = math.prod(logits.shape[:-1]) / dp
    vocab = logits.shape[-1] / (tp if parallel else 1)
    t = PASSES * tokens * vocab * 4 / prof.mem_bw
    if parallel and tp > 1:
        i = dim_names.index("tp")
        links = mesh_links(prof, tuple(mesh_shape))
        t += 3 * collective_s("all_reduce", tp, tokens * 4, links.bandwidth[i],
                              links.latency[i])
    return t


def cross_entropy_kept_bytes(local_numel: int, itemsize: int) -> int:
    """Bytes the last stage keeps per microbatch from its forward to its backward for the
    loss, on one device holding ``local_numel`` logits of ``itemsize`` bytes each (1/tp of
    the vocabulary under loss parallel): the logits themselves (the runtime's eager loss
    keeps them as the leaf it differentiates, :meth:`autopp.graph.StageGraphs.with_eager_loss`)
    plus the fp32 log-probabilities cross entropy's log-softmax saves for its backward (the
    fp32 upcast of lower-precision logits is freed after the log-softmax). The planned
    graph ends at the logits, so its saved values have neither."""
    return local_numel * (itemsize + 4)
