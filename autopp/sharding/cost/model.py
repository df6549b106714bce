"""The cost model: compute time of a node option and time of each redistribution.

Compute (per device): ``max(flops / (peak × efficiency), bytes / memory bandwidth)``, the
peak the dtype's (:func:`profiles.devices.matmul_peak`), FLOPs from torch's FLOP counter for
the global shapes divided by the devices that split the work (a mesh dim splits it when any
input or output is sharded on it). View-like ops cost nothing.

Communication (per device, per mesh dim whose placement changes, priced by
:func:`profiles.collectives.collective_s`): Partial → Replicate is an all-reduce, Partial →
Shard a reduce-scatter, Shard → Replicate an all-gather, Shard(a) → Shard(b) an all-to-all,
Replicate → Shard a local slice (free). Steps that shrink the local tensor run first;
``_StridedShard`` is priced like ``Shard``. Collectives an op runs inside its kernel
(:mod:`op_hooks`) are priced the same way and added to the op's time."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from autopp._compat import sharding as compat
from autopp.sharding.options import op_hooks
from autopp.profiles.collectives import collective_latency_s, collective_s
from autopp.profiles.devices import DeviceProfile, mesh_links
from autopp.graph.walk import is_view
from autopp.sharding.options.strategies import NodeStrategy, Option, local_shape, tensor_vals


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a redistribution."""

    kind: str
    """"all_reduce", "reduce_scatter", "all_gather", "all_to_all"."""
    mesh_dim: int
    bytes: int
    """Local (per-device) bytes of the tensor going in."""
    time_s: float


def _is_shard(p: Any) -> bool:
    return compat.placement_kind(p) in ("shard", "strided")


def _is_partial(p: Any) -> bool:
    return compat.placement_kind(p) == "partial"


_REDIST: dict[tuple, dict[tuple, tuple[float, tuple["Collective", ...]]]] = {}
"""Redistribution prices by (profile, mesh shape), shared by every CostModel of the process:
a price depends on the profile's numbers (the key holds the frozen profile itself, so a
profile re-registered with other numbers gets its own table) and the mesh's links alone.
A search builds a CostModel per probe stage, and the same activations recur across them."""

_REDIST_MAX = 1 << 21
"""Entries one table keeps before it starts again (bounds a long process's memory)."""


logger = logging.getLogger(__name__)

def dtype_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


class CostModel:
    """Prices options and redistributions on one mesh for one device profile; ``tf32``: fp32
    matmuls run on TF32 tensor cores (the plan's ``tf32``, :func:`profiles.devices.tf32_enabled`
    when it was made)."""

    def __init__(self, profile: DeviceProfile, mesh_shape: tuple[int, ...], tf32: bool = False):
        self.profile = profile
        self.mesh_shape = tuple(mesh_shape)
        self.tf32 = bool(tf32)
        self.links = mesh_links(profile, self.mesh_shape)
        self._redist = _REDIST.setdefault((profile, self.mesh_shape), {})
        self._flops: dict[Any, float] = {}
        self.flop_failures: dict[str, str] = {}
        """Op -> why its FLOP formula failed: such an op is priced by its memory traffic
        only (logged once per op; the stage plan lists them in its notes)."""

    # -- communication -------------------------------------------------------------------------

    def redistribute(
        self, src: tuple, dst: tuple, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[float, tuple[Collective, ...]]:
        """Time and collectives to move a tensor of global ``shape`` from ``src`` to ``dst``."""
        key = (src, dst, tuple(shape), dtype)
        hit = self._redist.get(key)
        if hit is None:
            if len(self._redist) >= _REDIST_MAX:
                self._redist.clear()
            same = len(src) == len(dst) and all(map(compat.same_placement, src, dst))
            hit = self._redist[key] = (0.0, ()) if same else self._redistribute(
                src, dst, shape, dtype)
        return hit

    def _redistribute(self, src, dst, shape, dtype):
        numel = math.prod(shape)
        shards = math.prod(n for p, n in zip(src, self.mesh_shape) if _is_shard(p))
        local = numel * dtype_bytes(dtype) / shards
        dims = [i for i in range(len(src)) if not compat.same_placement(src[i], dst[i])]

        def rank(i):  # shrinking steps first, growing (all_gather) last
            s, d = src[i], dst[i]
            if _is_shard(d) and not _is_shard(s):
                return 0
            if _is_shard(s) and _is_shard(d):
                return 1
            if _is_partial(s):
                return 2
            return 3

        total, steps = 0.0, []
        for i in sorted(dims, key=rank):
            s, d, n = src[i], dst[i], self.mesh_shape[i]
            if n == 1:  # a size-1 mesh dim: every placement is the same data
                continue
            if _is_partial(s) and compat.placement_kind(d) == "replicate":
                kind, after = "all_reduce", local
            elif _is_partial(s) and _is_shard(d):
                kind, after = "reduce_scatter", local / n
            elif _is_shard(s) and _is_shard(d):
                kind, after = "all_to_all", local
            elif _is_shard(s):  # -> Replicate or Partial
                kind, after = "all_gather", local * n
            elif _is_partial(d):  # Replicate -> Partial: keep one copy, zero the others
                kind, after = None, local
            else:  # Replicate -> Shard: local slice
                kind, after = None, local / n
            if kind is not None:
                t = self.collective_time(kind, i, local)
                total += t
                steps.append(Collective(kind, i, int(local), t))
            local = after
        return total, tuple(steps)

    # -- compute -------------------------------------------------------------------------------

    def global_flops(self, ns: NodeStrategy) -> float:
        node = ns.node
        if node in self._flops:
            return self._flops[node]
        flops = 0.0
        fn = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if ns.kind == "op" and fn is not None:
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
            try:
                with compat.unset_fake_temporarily():
                    flops = float(fn(*args, **kwargs, out_val=node.meta.get("val")))
            except Exception as e:  # noqa: BLE001 - a FLOP formula that cannot read these args
                flops = 0.0
                op = str(node.target)
                if op not in self.flop_failures:
                    self.flop_failures[op] = f"{type(e).__name__}: {e}"
                    logger.warning("FLOP formula of %s failed (%s): priced by its memory "
                                   "traffic only", op, self.flop_failures[op])
        self._flops[node] = flops
        return flops

    def compute_time(self, ns: NodeStrategy, opt: Option) -> float:
        """Per-device time of running ``ns.node`` as ``opt``."""
        if ns.kind not in ("op",) or is_view(ns.node):
            return 0.0
        placements = [p for p in opt.out if p is not None] + list(opt.ins)
        split = 1
        for i, n in enumerate(self.mesh_shape):
            if any(_is_shard(pl[i]) for pl in placements):
                split *= n
        flops = self.global_flops(ns) / split
        hooks = op_hooks.hooks_of(ns.node.target)
        if hooks is not None and hooks.busiest_share is not None:
            flops *= hooks.busiest_share(ns.node, opt)
        nbytes = 0.0
        vals = [v for v in tensor_vals(ns.node)]
        for v, pl in zip(vals, opt.out):
            if v is not None and pl is not None:
                nbytes += self.local_bytes(v, pl)
        for (src, k), pl in zip(ns.edges, opt.ins):
            v = tensor_vals(src)[k]
            nbytes += self.local_bytes(v, pl)
        out = next((v for v in vals if v is not None), None)
        dtype = out.dtype if out is not None else torch.float32
        t = max(flops / self.profile.flops(dtype, self.tf32), nbytes / self.profile.mem_bw)
        return t + self.kernel_comm_time(ns, opt)

    def kernel_comm_time(self, ns: NodeStrategy, opt: Option) -> float:
        """Seconds of the collectives ``ns.node``'s own kernel runs as ``opt`` (an op with
        :mod:`op_hooks`, e.g. routed experts dispatching tokens by all-to-all); 0 for others.
        The op blocks on them, so they are part of its time."""
        hooks = op_hooks.hooks_of(ns.node.target)
        if hooks is None:
            return 0.0
        return sum(self.collective_time(kind, dim, nbytes)
                   for kind, dim, nbytes in hooks.collectives(ns.node, opt, self.mesh_shape))

    def collective_time(self, kind: str, mesh_dims: int | tuple[int, ...],
                        local_bytes: float) -> float:
        """α-β time of one collective over ``mesh_dims`` (one dim, or several as one group)
        on ``local_bytes`` per device going in (the table in the module docstring;
        :func:`profiles.collectives.collective_s` on the dim's link). Over several dims
        (an all-to-all only) the group's ``n - 1`` exchange steps each pay the slowest dim's
        latency, the bytes that cross each dim's link (those whose destination differs in
        that coordinate: ``(n_d-1)/n_d`` of them) are timed on it, and the slowest link
        sets the transfer time."""
        dims = (mesh_dims,) if isinstance(mesh_dims, int) else tuple(mesh_dims)
        dims = tuple(d for d in dims if self.mesh_shape[d] > 1)
        if not dims:
            return 0.0
        if len(dims) == 1:
            (d,) = dims
            return collective_s(kind, self.mesh_shape[d], local_bytes,
                                self.links.bandwidth[d], self.links.latency[d])
        if kind != "all_to_all":
            raise ValueError(f"{kind} over several mesh dims at once is not priced")
        n = math.prod(self.mesh_shape[d] for d in dims)
        lat = max(self.links.latency[d] for d in dims)
        return collective_latency_s(kind, n, lat) + max(
            (self.mesh_shape[d] - 1) / self.mesh_shape[d] * local_bytes
            / self.links.bandwidth[d] for d in dims)

    def local_bytes(self, val: torch.Tensor, placements: tuple) -> float:
        shape = local_shape(val.shape, placements, self.mesh_shape)
        if shape is None:  # strided/uneven: approximate by the shard count
            shards = math.prod(n for p, n in zip(placements, self.mesh_shape) if _is_shard(p))
            return val.numel() * val.element_size() / shards
        return math.prod(shape) * val.element_size()
