"""Device profiles: what the cost model assumes about a device and its links.

Chosen by configuration (a name or a :class:`DeviceProfile`), never by querying the local
device: a plan made on a CPU machine for H100s is the plan the H100s get.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

ProfileName = Literal["H100", "H200", "A100", "CPU"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """Peak rates of one device and of the links between devices."""

    name: str
    """Label used in reports."""
    flops_bf16: float
    """Dense bf16/fp16 matmul peak, FLOP/s."""
    flops_fp32: float
    """fp32 matmul peak, FLOP/s (TF32 tensor cores on GPUs)."""
    mem_bw: float
    """Device memory bandwidth, bytes/s."""
    memory_bytes: float
    """Device memory, bytes."""
    compute_efficiency: float = 0.6
    """Fraction of the peak FLOP rate a large matmul reaches."""
    devices_per_node: int = 8
    """Devices joined by the fast intra-node link."""
    intra_node_bw: float
    """Per-device bandwidth of the intra-node link (NVLink), bytes/s, one direction."""
    inter_node_bw: float
    """Per-device bandwidth between nodes (InfiniBand/RoCE), bytes/s."""
    intra_node_latency: float = 5e-6
    """Latency of one collective step inside a node, s."""
    inter_node_latency: float = 20e-6
    """Latency of one collective step across nodes, s."""

    def flops(self, dtype: torch.dtype) -> float:
        peak = self.flops_bf16 if dtype in (torch.bfloat16, torch.float16) else self.flops_fp32
        return peak * self.compute_efficiency


PROFILES: dict[str, DeviceProfile] = {
    "H100": DeviceProfile(
        name="H100",
        flops_bf16=989e12,
        flops_fp32=494e12,
        mem_bw=3.35e12,
        memory_bytes=80e9,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "H200": DeviceProfile(
        name="H200",
        flops_bf16=989e12,
        flops_fp32=494e12,
        mem_bw=4.8e12,
        memory_bytes=141e9,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "A100": DeviceProfile(
        name="A100",
        flops_bf16=312e12,
        flops_fp32=156e12,
        mem_bw=2.0e12,
        memory_bytes=80e9,
        intra_node_bw=300e9,
        inter_node_bw=25e9,
    ),
    "CPU": DeviceProfile(
        name="CPU",
        flops_bf16=0.2e12,
        flops_fp32=0.2e12,
        mem_bw=50e9,
        memory_bytes=64e9,
        compute_efficiency=0.5,
        devices_per_node=1,
        intra_node_bw=5e9,
        inter_node_bw=1.25e9,
        intra_node_latency=50e-6,
        inter_node_latency=100e-6,
    ),
}


def get_profile(profile: str | DeviceProfile) -> DeviceProfile:
    """A profile by name ("H100", "H200", "A100", "CPU") or the profile itself."""
    if isinstance(profile, DeviceProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(
            f"unknown device profile {profile!r}; choose one of {sorted(PROFILES)} or pass a "
            "DeviceProfile"
        ) from None


@dataclass(frozen=True, slots=True)
class MeshLinks:
    """Bandwidth and latency of the collectives over each mesh dim."""

    bandwidth: tuple[float, ...]
    latency: tuple[float, ...]


def mesh_links(profile: DeviceProfile, mesh_shape: tuple[int, ...]) -> MeshLinks:
    """Links of a row-major mesh: a dim whose ranks all sit in one node uses the fast link.

    Dim ``i`` spans ``stride_i * size_i`` consecutive ranks (stride = product of later sizes);
    when that span fits in ``devices_per_node`` the collective stays inside a node.
    """
    bw, lat = [], []
    stride = 1
    spans = []
    for size in reversed(mesh_shape):
        spans.append(stride * size)
        stride *= size
    for span in reversed(spans):
        intra = span <= profile.devices_per_node
        bw.append(profile.intra_node_bw if intra else profile.inter_node_bw)
        lat.append(profile.intra_node_latency if intra else profile.inter_node_latency)
    return MeshLinks(tuple(bw), tuple(lat))


def with_overrides(profile: DeviceProfile, **changes) -> DeviceProfile:
    """A copy of ``profile`` with some fields changed (e.g. ``inter_node_bw=100e9``)."""
    return replace(profile, **changes)
