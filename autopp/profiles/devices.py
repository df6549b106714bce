"""Device profiles: what the cost model assumes about a device and its links.

Chosen by configuration (a name or a :class:`DeviceProfile`), never by querying the local
device unless asked to: a plan made on a CPU machine for H100s is the plan the H100s get.
The one exception is explicit: the name ``"measure"`` measures the machine at hand (see
:mod:`autopp.profiles.measure`) and gives a profile named ``"measured-<hash>"``, stored as
JSON in :func:`profile_cache_dir` so that the name resolves in any process on that host.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

ProfileName = Literal["H100", "H200", "A100", "CPU", "measure"]

MEASURE = "measure"
"""The profile name that measures this machine (or reads its cached measurement)."""
MEASURED_PREFIX = "measured-"
"""Names of measured profiles: this prefix and a hash of what was measured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """Peak rates of one device and of the links between devices."""

    name: str
    """Label used in reports."""
    flops_bf16: float
    """Dense bf16/fp16 matmul peak, FLOP/s."""
    flops_fp32: float
    """fp32 matmul peak, FLOP/s, at torch's default fp32 matmul precision ("highest": true
    fp32, no TF32 tensor cores; :func:`matmul_peak`)."""
    flops_tf32: float | None = None
    """fp32 matmul peak with TF32 tensor cores, FLOP/s: what fp32 matmuls reach when the
    user lets torch use TF32 (:func:`tf32_enabled`). None: no faster path than
    ``flops_fp32`` (CPUs; profiles stored before this field existed)."""
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
    p2p_bw: float | None = None
    """Bandwidth of a point-to-point send between neighbouring pipeline ranks, bytes/s;
    None: the pp dim's collective link (:func:`mesh_links`) is used."""
    p2p_latency: float | None = None
    """Latency of one point-to-point send, s; None: the pp dim's collective link latency."""
    shared_cores: int | None = None
    """CPU cores that all ranks share (a measured CPU profile with more ranks than cores;
    its rates were measured with every rank busy at once); None: a device per rank."""
    device_type: str = "cuda"
    """The torch device type the profile's devices are ("cuda", "cpu"): how DTensor runs a
    redistribution there (a CPU mesh has no all-to-all: DTensor gathers the whole tensor
    and keeps a chunk), which the dry run's lowered graphs follow."""
    communicator_bytes: float = 0.0
    """Device memory a rank's communicator holds per process group it uses (each pp, dp or
    tp group of size > 1, :func:`autopp.schedules.memory_terms.communicator_bytes`), held
    for the whole run. 0 for CPU / gloo (its buffers are host memory it allocates per
    call). The GPU profiles use :data:`NCCL_COMMUNICATOR_BYTES`."""

    def flops(self, dtype: torch.dtype, tf32: bool = False) -> float:
        """The FLOP rate a large matmul in ``dtype`` reaches: :func:`matmul_peak` times
        ``compute_efficiency``."""
        return matmul_peak(self, dtype, tf32) * self.compute_efficiency


def tf32_enabled() -> bool:
    """Whether torch runs fp32 matmuls on TF32 tensor cores in this process: the user set
    ``torch.set_float32_matmul_precision("high")`` (or ``"medium"``) or
    ``torch.backends.cuda.matmul.allow_tf32 = True``. torch's default ("highest") does not.
    Read once where planning options are formed (``PlannerOptions.tf32``); the plan records
    it."""
    if torch.get_float32_matmul_precision() in ("high", "medium"):
        return True
    return bool(torch.backends.cuda.matmul.allow_tf32)


def matmul_peak(profile: DeviceProfile, dtype: torch.dtype, tf32: bool = False) -> float:
    """The one rule for which peak a matmul in ``dtype`` runs at, FLOP/s: bf16 / fp16 at
    ``flops_bf16``; fp32 at ``flops_tf32`` when ``tf32`` (see :func:`tf32_enabled`) and the
    profile has a TF32 rate, else at ``flops_fp32``."""
    if dtype in (torch.bfloat16, torch.float16):
        return profile.flops_bf16
    if tf32 and profile.flops_tf32 is not None:
        return profile.flops_tf32
    return profile.flops_fp32


NCCL_COMMUNICATOR_BYTES = 4 * 2**20 * 2 * 8
"""Per NCCL communicator (one process group), 64 MiB: NCCL allocates ``NCCL_BUFFSIZE``
(4 MiB by default) per channel per peer; in a ring (and a pipeline's send/recv) a rank has
2 peers, the previous and the next, and we assume 8 channels: 4 MiB x 2 peers x 8 channels
= 64 MiB. An allowance, not a measurement: ``NCCL_BUFFSIZE``, the channel count NCCL picks
for the topology and its LL / LL128 buffers move it."""


PROFILES: dict[str, DeviceProfile] = {
    "H100": DeviceProfile(
        name="H100",
        communicator_bytes=NCCL_COMMUNICATOR_BYTES,
        flops_bf16=989e12,
        flops_fp32=67e12,
        flops_tf32=494e12,
        mem_bw=3.35e12,
        memory_bytes=80e9,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "H200": DeviceProfile(
        name="H200",
        communicator_bytes=NCCL_COMMUNICATOR_BYTES,
        flops_bf16=989e12,
        flops_fp32=67e12,
        flops_tf32=494e12,
        mem_bw=4.8e12,
        memory_bytes=141e9,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
    ),
    "A100": DeviceProfile(
        name="A100",
        communicator_bytes=NCCL_COMMUNICATOR_BYTES,
        flops_bf16=312e12,
        flops_fp32=19.5e12,
        flops_tf32=156e12,
        mem_bw=2.0e12,
        memory_bytes=80e9,
        intra_node_bw=300e9,
        inter_node_bw=25e9,
    ),
    "CPU": DeviceProfile(
        name="CPU",
        device_type="cpu",
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

#: A100 40 GB: the 80 GB part's compute and links, its own memory and bandwidth.
PROFILES["A100-40GB"] = replace(PROFILES["A100"], name="A100-40GB",
                                memory_bytes=40e9, mem_bw=1.555e12)


#: Built-in profile of a CUDA device, by a substring of its name; A100s by memory too.
_CUDA_NAMES = (("H200", "H200"), ("H100", "H100"), ("A100", "A100"))


def profile_for_device(device_type: str) -> str:
    """The built-in profile of the device this process runs on: "CPU" for "cpu"; for
    "cuda", the current device by its name and memory (H100, H200, A100 80 GB, A100 40 GB).
    An unknown GPU is an error naming ``PlannerOptions(profile=)``: planning it as an H100
    would plan another memory size and speed."""
    if device_type == "cpu":
        return "CPU"
    if device_type != "cuda":
        raise ValueError(f"no default device profile for device type {device_type!r}: pass "
                         f"profile= in the planner's options, PlannerOptions(profile=...): one of "
                         f"{sorted(PROFILES)} or {MEASURE!r}")
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    for part, name in _CUDA_NAMES:
        if part in props.name:
            if name == "A100" and props.total_memory < 60e9:
                return "A100-40GB"
            return name
    raise ValueError(
        f"no built-in profile for this GPU ({props.name}, {props.total_memory / 1e9:.0f} GB): "
        f"pass profile= in the planner's options, PlannerOptions(profile=...): one of "
        f"{sorted(PROFILES)}, {MEASURE!r} to measure it, or a profile registered with "
        "autopp.profiles.register_profile")


_REGISTERED: dict[str, DeviceProfile] = {}


def register_profile(profile: DeviceProfile) -> DeviceProfile:
    """Make ``profile`` resolvable by its name in this process (``get_profile(profile.name)``).

    A later registration under the same name replaces the earlier one. The built-in names
    (:data:`PROFILES`) and ``"measure"`` cannot be registered. Returns ``profile``.
    """
    if not isinstance(profile, DeviceProfile):
        raise TypeError(f"register_profile takes a DeviceProfile, got {type(profile).__name__}")
    if profile.name in PROFILES or profile.name == MEASURE:
        raise ValueError(
            f"profile name {profile.name!r} is reserved (built-in profiles {sorted(PROFILES)} "
            f"and {MEASURE!r}); give the profile another name, e.g. "
            f"with_overrides(profile, name='my-{profile.name}')"
        )
    _REGISTERED[profile.name] = profile
    return profile


def registered_profile(name: str) -> DeviceProfile | None:
    """The profile registered under ``name`` in this process (:func:`register_profile`)."""
    return _REGISTERED.get(name)


def registered_names() -> list[str]:
    """The names registered in this process, sorted."""
    return sorted(_REGISTERED)


def profile_cache_dir() -> Path:
    """Where measured profiles are stored: ``$AUTOPP_PROFILE_CACHE`` if set, else
    ``~/.cache/autopp/profiles``."""
    return Path(os.environ.get("AUTOPP_PROFILE_CACHE",
                               Path.home() / ".cache" / "autopp" / "profiles"))


def save_profile(profile: DeviceProfile, path: Path | None = None,
                 details: dict[str, Any] | None = None) -> Path:
    """Write ``profile`` as JSON and return the path.

    Args:
        profile: the profile to store.
        path: the file; default ``profile_cache_dir() / f"{profile.name}.json"``.
        details: JSON values stored beside the profile (e.g. the raw timings of a
            measurement); :func:`load_profile` ignores them.
    """
    if path is None:
        path = profile_cache_dir() / f"{profile.name}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": 1, "profile": dataclasses.asdict(profile), "details": details or {}}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """Read a profile written by :func:`save_profile`: a file path, or a profile name looked
    up in :func:`profile_cache_dir`. The profile is registered (:func:`register_profile`)."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = profile_cache_dir() / f"{name_or_path}.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"no stored profile {str(name_or_path)!r}: {path} does not exist. Measure it on "
            f"the machine it describes (get_profile({MEASURE!r}) or "
            "autopp.profiles.measure.measure_profile()), copy its JSON file into "
            f"{path.parent}, or point $AUTOPP_PROFILE_CACHE at the directory that holds it"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile file {path} is not valid JSON ({e}); delete it and "
                         "measure again") from None
    known = {f.name for f in dataclasses.fields(DeviceProfile)}
    fields = doc.get("profile") if isinstance(doc, dict) else None
    if not isinstance(fields, dict) or not set(fields) <= known:
        raise ValueError(f"profile file {path} does not hold a DeviceProfile (expected "
                         f"{{'profile': {{...}}}} with fields {sorted(known)}); delete it and "
                         "measure again")
    if path != Path(name_or_path) and fields.get("name") != str(name_or_path):
        raise ValueError(f"profile file {path} holds profile {fields.get('name')!r}, not "
                         f"{str(name_or_path)!r}; rename or delete the file")
    return register_profile(DeviceProfile(**fields))


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
