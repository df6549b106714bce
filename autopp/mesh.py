"""World device mesh with named dims (pp, dp, tp) and each rank's stage sub-mesh.

The world mesh always has the three dims in the order ``("pp", "dp", "tp")`` (a size may be 1),
so that a stage's sub-mesh, the world mesh minus ``pp``, is ``mesh["dp", "tp"]`` everywhere.
Works on cpu/gloo, cuda/nccl and the fake process group (plans for hundreds of ranks made on
one machine, see :func:`init_fake_world`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopp._compat import gloo

#: Names of the world mesh dims, outermost first. pp is outermost so that the ranks of one
#: stage (its dp x tp sub-mesh) are contiguous, as torchtitan lays them out.
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "tp")
#: Dims of a stage's sub-mesh.
STAGE_DIMS: tuple[str, ...] = ("dp", "tp")


def check_mesh_sizes(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Validate mesh dim sizes against the world size; returns sizes for all of MESH_DIMS.

    Raises ValueError naming the numbers, e.g. "pp=2 × dp=2 × tp=2 needs 8 ranks, got 6".
    """
    unknown = [k for k in sizes if k not in MESH_DIMS]
    if unknown:
        raise ValueError(
            f"unknown mesh dim name(s) {unknown}; autopp's mesh dims are {list(MESH_DIMS)}"
        )
    full = {d: int(sizes.get(d, 1)) for d in MESH_DIMS}
    bad = {d: s for d, s in full.items() if s < 1}
    if bad:
        raise ValueError(
            "mesh dim sizes must be at least 1, got "
            + ", ".join(f"{d}={s}" for d, s in bad.items())
        )
    need = math.prod(full.values())
    if need != world_size:
        spec = " × ".join(f"{d}={full[d]}" for d in MESH_DIMS)
        raise ValueError(
            f"{spec} needs {need} ranks, got {world_size}; "
            f"choose sizes whose product is the world size"
        )
    return full


def local_rank() -> int | None:
    """This process's rank on its node, as the launcher says it (torchrun's LOCAL_RANK,
    Slurm's SLURM_LOCALID); None when neither is set."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def bind_local_device() -> torch.device:
    """Bind this process to its own GPU (``torch.cuda.set_device(local_rank)``) and return
    it; the CPU when CUDA is not available. Call it before ``init_process_group``."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = local_rank()
    if local is None:
        raise RuntimeError("LOCAL_RANK (torchrun) or SLURM_LOCALID (srun) is not set: "
                           "launch with torchrun, or call torch.cuda.set_device yourself")
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {local} but only {torch.cuda.device_count()} GPUs "
                           "are visible: launch at most one process per GPU")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def device_type_of_backend(backend: str) -> str:
    """The mesh device type a process group backend moves tensors on: "cuda" for NCCL,
    "cpu" for gloo and the fake process group (a "cpu:gloo,cuda:nccl" backend: "cuda")."""
    return "cuda" if "nccl" in backend else "cpu"


def _check_bound_device() -> None:
    """On CUDA, each rank must compute on its own GPU, not every rank on GPU 0."""
    local = local_rank()
    if local is not None and torch.cuda.device_count() > 1 and \
            torch.cuda.current_device() != local % torch.cuda.device_count():
        raise RuntimeError(
            f"rank {dist.get_rank()}: local rank {local} but CUDA device "
            f"{torch.cuda.current_device()} is current, so ranks would share a GPU: call "
            f"torch.cuda.set_device({local}) (or autopp.mesh.bind_local_device()) before "
            "building the mesh")


def build_world_mesh(
    *,
    pp: int = 1,
    dp: int = 1,
    tp: int = 1,
    device_type: str | None = None,
) -> DeviceMesh:
    """Build the world DeviceMesh with named dims ``("pp", "dp", "tp")``.

    Args:
        pp: number of pipeline ranks (each owns one or more stages).
        dp: data-parallel degree inside each stage's sub-mesh.
        tp: tensor-parallel degree inside each stage's sub-mesh.
        device_type: "cpu" (gloo, and the fake process group) or "cuda" (nccl); None
            (default): the one the default process group's backend uses
            (:func:`device_type_of_backend`). On CUDA each rank must be bound to its own GPU
            (:func:`bind_local_device`); a rank on another rank's GPU is an error.

    The default process group must already be initialised (torchrun +
    ``dist.init_process_group``, or :func:`init_fake_world`).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: launch with torchrun and call "
            "torch.distributed.init_process_group(), or autopp.mesh.init_fake_world(n) to plan"
        )
    sizes = check_mesh_sizes({"pp": pp, "dp": dp, "tp": tp}, dist.get_world_size())
    if device_type is None:
        device_type = device_type_of_backend(str(dist.get_backend()))
    if device_type == "cuda":
        _check_bound_device()
    # the mesh's gloo groups get one worker thread each (autopp/_compat/gloo.py); a world
    # group made before autopp was imported has torch's two (warned once), so a dim over
    # every rank gets a group of its own instead of reusing it
    gloo.install()
    world = dist.get_world_size()
    own = {d: "gloo" for d in MESH_DIMS if sizes[d] == world} \
        if device_type == "cpu" and gloo.check_group() else {}
    mesh = init_device_mesh(
        device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS,
        backend_override=own or None,
    )
    if dp > 1 and tp > 1:
        # one group over each stage's dp x tp devices: experts split over both dims
        # exchange tokens by one all-to-all in it (autopp.sharding.options.expert_dispatch)
        from autopp._compat.sharding import flatten_mesh_dims

        flatten_mesh_dims(mesh, STAGE_DIMS)
    return mesh


def check_world_mesh(mesh: DeviceMesh) -> None:
    """Raise ValueError unless ``mesh`` has exactly autopp's named dims."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != MESH_DIMS:
        raise ValueError(
            f"autopp needs a world mesh with dims {MESH_DIMS} (any may be size 1), got "
            f"dims {names or None} of shape {tuple(mesh.shape)}; build one with "
            "autopp.build_world_mesh(pp=..., dp=..., tp=...)"
        )


def stage_sub_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """This rank's stage sub-mesh: the world mesh minus ``pp`` (dims ``("dp", "tp")``)."""
    check_world_mesh(mesh)
    return mesh[STAGE_DIMS]


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """Size of each named dim of ``mesh``."""
    return dict(zip(mesh.mesh_dim_names or (), mesh.shape))


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """Initialise torch.distributed with the fake process group (no devices, no peers).

    Collectives return immediately without moving data; DTensor's sharding rules and
    DeviceMesh work for any world size, which is what planning a large mesh needs.
    """
    from autopp._compat.distributed import fake_store

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
