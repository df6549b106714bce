"""Every private torch API the planner uses, in one place.

A torch upgrade that moves DTensor's sharding propagator, AOTAutograd's joint export or the
fake-tensor helpers should only need changes here. Nothing else in ``autopp.sharding`` imports
an underscore module of torch.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    TupleStrategy,
)
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

__all__ = [
    "DTensorSpec",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "TensorMeta",
    "TupleStrategy",
    "cheap_redistribute_costs",
    "autograd_inside_custom_op",
    "buffer_mutated",
    "export_joint",
    "decomp_op_strategy",
    "has_decomp_rule",
    "has_rule",
    "is_grad_output",
    "is_param_input",
    "is_buffer_input",
    "is_op_overload",
    "tree_leaves",
    "tree_map",
    "is_plain_input",
    "is_plain_output",
    "is_tangent_input",
    "op_strategy",
    "placement_kind",
    "same_placement",
    "unset_fake_temporarily",
    "is_fake",
]

StridedShard = _StridedShard


def _topk_cache_key_holds_k() -> None:
    """DTensor's sharding cache keys ``aten.topk`` by its non-tensor arguments from ``dim``
    on (``RuntimeSchemaInfo(2)``), not by ``k``: a second topk of an input of the same
    shape and placement with another ``k`` (a second MoE model in the process, a layer
    routing to another number of experts) is served the first's output shape, and the
    ops after it fail or compute on the wrong shapes. Keyed from ``k`` on. torch 2.13 keeps
    topk's key in ``op_to_schema_info``; 2.14 (a single-dim strategy) in its own table."""
    import dataclasses

    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.topk.default
    for table in ("op_to_schema_info", "op_to_schema_info_for_single_dim_strategy"):
        infos = getattr(prop, table, None) or {}
        info = infos.get(op)
        if info is not None and info.static_argnum > 1:
            infos[op] = dataclasses.replace(info, static_argnum=1)


_topk_cache_key_holds_k()


def _strided_shard_sizes_outside_traces() -> None:
    """``_StridedShard.local_shard_size_and_offset`` builds an index tensor and reads it back
    with ``tolist``; torch 2.14's redistribution costs ask it while DTensor propagates a
    sharding inside autopp's fake-mode traces (a unit's lowering), where that tensor is fake
    and the read fails (``DataDependentOutputException``). For plain int sizes it is
    metadata: run outside the fake and proxy modes (symbolic sizes: as torch runs it)."""
    own = _StridedShard.__dict__.get("local_shard_size_and_offset")
    if own is None or getattr(own, "_autopp_untraced", False):
        return
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    @functools.wraps(own)
    def sizes(self: Any, curr_local_size: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(curr_local_size, int):
            return own(self, curr_local_size, *args, **kwargs)
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            return own(self, curr_local_size, *args, **kwargs)

    sizes._autopp_untraced = True  # type: ignore[attr-defined]
    _StridedShard.local_shard_size_and_offset = sizes  # type: ignore[method-assign]


_strided_shard_sizes_outside_traces()

_KINDS: dict[type, str] = {}


def placement_kind(p: Any) -> str:
    """"strided", "shard", "partial", "replicate" or "other": what ``isinstance`` says of
    ``p`` against DTensor's placement classes, read once per placement type. The placement
    classes are opaque types whose ``isinstance`` runs a Python metaclass hook (about 1 µs a
    call); the planner asks millions of times while it builds a 70B search's ILPs."""
    kind = _KINDS.get(type(p))
    if kind is None:
        kind = _KINDS[type(p)] = (
            "strided" if isinstance(p, _StridedShard) else "shard" if isinstance(p, Shard)
            else "partial" if isinstance(p, Partial) else "replicate"
            if isinstance(p, Replicate) else "other")
    return kind


def same_placement(p: Any, q: Any) -> bool:
    """``p == q`` for two DTensor placements, by type first: pybind's ``==`` across two
    placement types raises and catches inside (about 2.5 µs a pair, against 0.03 µs here);
    the planner compares placements millions of times while it prices redistributions."""
    return p is q or (type(p) is type(q) and p == q)


# ---------------------------------------------------------------------------------------------
# AOTAutograd joint export and its descriptors
# ---------------------------------------------------------------------------------------------


def export_joint(module: torch.nn.Module, args: tuple[Any, ...],
                 contexts: Sequence[contextlib.AbstractContextManager] = ()) -> torch.fx.GraphModule:
    """Functional joint forward+backward aten graph of ``module(*args)``, traced inside
    ``contexts`` (e.g. :func:`autopp.tracing.on_meta`).

    Placeholders carry ``meta["desc"]`` (parameter, buffer, user input or tangent); the output
    node carries ``meta["desc"]`` as a list (forward outputs, then gradients with ``grad_of``).
    Returned after AOT's fake mode is left, so strategy enumeration runs on plain metadata.
    """
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        joint = aot_export_joint_with_descriptors(stack, module, args)
        gm = joint.graph_module
    return gm


def global_module_hooks() -> tuple[dict, ...]:
    """torch's module hooks registered for every module (``register_module_forward_hook``
    and the like), each table hook id -> hook or flag: what a trace of any module runs."""
    from torch.nn.modules import module as _m

    return (_m._global_forward_pre_hooks, _m._global_forward_hooks,
            _m._global_forward_hooks_always_called, _m._global_forward_hooks_with_kwargs,
            _m._global_backward_pre_hooks, _m._global_backward_hooks)


def is_param_input(desc: Any) -> bool:
    return isinstance(desc, _desc.ParamAOTInput)


def is_buffer_input(desc: Any) -> bool:
    return isinstance(desc, _desc.BufferAOTInput)


def is_plain_input(desc: Any) -> bool:
    return isinstance(desc, _desc.PlainAOTInput)


def is_tangent_input(desc: Any) -> bool:
    return isinstance(desc, _desc.TangentAOTInput)


def is_plain_output(desc: Any) -> bool:
    return isinstance(desc, _desc.PlainAOTOutput)


def is_grad_output(desc: Any) -> bool:
    return isinstance(desc, _desc.GradAOTOutput)


def buffer_mutated(desc: Any) -> str | None:
    """For an output that is a buffer's new value (the forward wrote the buffer in place),
    the buffer's FQN."""
    if isinstance(desc, _desc.InputMutationAOTOutput) and isinstance(
            desc.mutated_input, _desc.BufferAOTInput):
        return desc.mutated_input.target
    return None


@contextlib.contextmanager
def autograd_inside_custom_op() -> Iterator[None]:
    """Autograd back on inside a custom op's kernel (which torch runs below autograd), so
    the kernel can differentiate its own local computation with the model's own ops."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(
        torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def desc_index(desc: Any) -> int | None:
    """Index of a plain input/output, or of the output a tangent belongs to."""
    if isinstance(desc, _desc.TangentAOTInput):
        return desc_index(desc.output)
    return getattr(desc, "idx", None)


def desc_target(desc: Any) -> str | None:
    """FQN of a parameter/buffer input, or of the input a gradient belongs to."""
    if isinstance(desc, _desc.GradAOTOutput):
        inner = desc.grad_of
        if isinstance(inner, (_desc.ParamAOTInput, _desc.BufferAOTInput)):
            return inner.target
        return None
    return getattr(desc, "target", None)


def grad_of_plain_index(desc: Any) -> int | None:
    """For a gradient output of a user input, that input's index."""
    if isinstance(desc, _desc.GradAOTOutput) and isinstance(desc.grad_of, _desc.PlainAOTInput):
        return desc.grad_of.idx
    return None


# ---------------------------------------------------------------------------------------------
# DTensor's sharding rules
# ---------------------------------------------------------------------------------------------


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def has_rule(op: Any) -> bool:
    prop = _propagator()
    return op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs


def has_decomp_rule(op: Any) -> bool:
    """DTensor can derive ``op``'s strategies by tracing its decomposition."""
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    return DecompShardingStrategy.has_decomp(op)


def decomp_op_strategy(op: Any, args_schema: tuple[Any, ...], kwargs_schema: dict) -> Any:
    """Strategies of an op with no rule, through DTensor's decomposition tracing.

    Takes ``DTensorSpec`` arguments (one placement per input); returns an ``OpStrategy`` with
    the candidate combinations DTensor found, or None.
    """
    prop = _propagator()
    prop.decomp_strategy.ensure_schema_info(op)
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=prop.op_to_schema_info.get(op))
    return prop.decomp_strategy.propagate_strategy(schema)


def is_single_dim_rule(op: Any) -> bool:
    """True when DTensor's rule for ``op`` is a single-mesh-dim rule expanded to the mesh.

    Such rules enumerate every combination themselves and read their inputs' strategies only
    to learn which sharding kinds are in use, so they must get one option per input.
    """
    return op in _propagator().op_single_dim_strategy_funcs


def op_strategy(
    op: Any,
    args_schema: tuple[Any, ...],
    kwargs_schema: dict[str, Any],
    out_tensor_meta: Any,
    mesh: Any,
) -> Any:
    """Ask DTensor's registry for the strategies of ``op``.

    ``args_schema`` holds an ``OpStrategy`` (possibly with many options) in place of each tensor
    argument. Returns an ``OpStrategy`` / ``TupleStrategy``, or None when DTensor has no rule.
    """
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _expand_single_dim_strategy_to_mesh,
    )

    prop = _propagator()
    single = prop.op_single_dim_strategy_funcs.get(op)
    info = (
        prop.op_to_schema_info_for_single_dim_strategy.get(op)
        if single is not None
        else prop.op_to_schema_info.get(op)
    )
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=info)
    if single is not None:
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, single, out_tensor_meta)
        return fn(op, schema.args_meta, schema.kwargs_meta)
    func = prop.op_strategy_funcs.get(op)
    if func is None:
        return None
    return func(schema)


@contextlib.contextmanager
def cheap_redistribute_costs() -> Iterator[None]:
    """Make DTensor's rules skip their redistribute-cost estimates while we enumerate.

    The planner prices every redistribution with its own analytic model (costs.py), so the
    cost matrices DTensor attaches to each option are unused; computing them is what makes
    enumeration slow (a graph search per query for ``_StridedShard`` placements). Restored on
    exit.
    """
    from torch.distributed.tensor import _utils as t_utils
    from torch.distributed.tensor._ops import utils as ops_utils

    def zero_cost(current: Any, target: Any) -> float:
        return 0.0

    saved = [(m, m.redistribute_cost) for m in (ops_utils, t_utils)]
    try:
        for m, _ in saved:
            m.redistribute_cost = zero_cost
        yield
    finally:
        for m, fn in saved:
            m.redistribute_cost = fn


def decomposition(op: Any):
    """torch's decomposition of ``op`` into simpler aten ops, or None.

    Used at run time for ops a trace on meta picked but the running backend lacks (e.g.
    ``_fused_rms_norm_backward`` has no CPU kernel).
    """
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


def is_op_overload(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def tree_leaves(tree: Any) -> list[Any]:
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def tree_map(fn: Any, tree: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def make_spec(mesh: Any, placements: Sequence[Placement], meta: TensorMeta | None) -> DTensorSpec:
    return DTensorSpec(mesh=mesh, placements=tuple(placements), tensor_meta=meta)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype)


# ---------------------------------------------------------------------------------------------
# Lowering a plan to a local graph (lower.py)
# ---------------------------------------------------------------------------------------------


def redistribution_peak_bytes(mesh: Any, val: torch.Tensor, src: Sequence[Placement],
                              dst: Sequence[Placement]) -> int:
    """The largest local tensor DTensor's own redistribution of ``val`` (a global value)
    from ``src`` to ``dst`` makes on this rank, its end included: it changes one mesh dim at
    a time in the order ``_gen_transform_infos`` plans, and a tensor dim sharded by several
    mesh dims is gathered over the inner ones before the outer one changes (a nested
    ``S(1), S(1)`` into ``R, S(1)`` passes through the whole tensor)."""
    size = val.element_size()
    current = list(src)
    peak = math.prod(local_shape(val.shape, mesh, current)) * size
    for mesh_dim, placement in _transform_steps(mesh, val, tuple(src), tuple(dst)):
        current[mesh_dim] = placement
        peak = max(peak, math.prod(local_shape(val.shape, mesh, current)) * size)
    return peak


_STEPS: dict[tuple, tuple[tuple[int, Placement], ...]] = {}
"""DTensor's greedy redistribution steps by (mesh shape, tensor rank, src, dst): the
greedy planner's steps depend on the placements alone, not on the tensor's sizes (its
graph-based planner, used for ``_StridedShard``, weighs sizes and is asked every time)."""


def _transform_steps(mesh: Any, val: torch.Tensor, src: tuple, dst: tuple
                     ) -> tuple[tuple[int, Placement], ...]:
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    key = (tuple(mesh.shape), val.dim(), src, dst)
    steps = _STEPS.get(key)  # strided pairs are never stored, so a hit is not strided
    if steps is None:
        strided = any(placement_kind(p) == "strided" for p in (*src, *dst))
        meta = tensor_meta(val)
        steps = tuple((t.mesh_dim, t.src_dst_placements[1]) for t in _gen_transform_infos(
            make_spec(mesh, src, meta), make_spec(mesh, dst, meta)))
        if not strided:
            _STEPS[key] = steps
    return steps


@contextlib.contextmanager
def shard_to_shard_as_on(device_type: str) -> Iterator[None]:
    """Redistributions from one shard dim to another traced as ``device_type`` runs them,
    whatever the mesh's own type: on a CPU mesh DTensor all-gathers the whole tensor and
    keeps a chunk (gloo has no all-to-all; the gathered tensor is mesh-dim times the
    shard), on a device mesh it calls its all-to-all op. The dry run lowers a GPU
    target's stages on a fake CPU mesh; without this its graphs (and the working memory
    read off them) would hold the CPU path's gathers."""
    if device_type == "cpu":
        yield
        return
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import placement_types

    def device_alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
        # the all-to-all as a functional collective (what the lowered graphs hold): chunk
        # ``shard_dim``, exchange chunk i with rank i, concatenate on ``gather_dim``; no
        # tensor larger than the input (the caller pads to even chunks)
        n = mesh.size(mesh_dim)
        chunks = torch.stack(torch.chunk(input, n, dim=shard_dim))
        out = funcol.all_to_all_single(chunks, None, None, (mesh, mesh_dim))
        return torch.cat(list(funcol.wait_tensor(out).unbind(0)), dim=gather_dim)

    saved = placement_types.shard_dim_alltoall
    placement_types.shard_dim_alltoall = device_alltoall
    try:
        yield
    finally:
        placement_types.shard_dim_alltoall = saved


def local_shape(global_shape: Sequence[int], mesh: Any, placements: Sequence[Placement]):
    """This rank's shard shape of a tensor of ``global_shape`` in ``placements``."""
    return _local_shape(tuple(global_shape), mesh, tuple(placements))


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(global_shape: tuple, mesh: Any, placements: tuple) -> tuple[int, ...]:
    # memoised: the planner asks for the same few shapes in many placements (each
    # redistribution path's steps), and DTensor's helper looks up the rank's coordinate
    # every time (30% of building a 70B block's ILP)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(
        compute_local_shape_and_global_offset(global_shape, mesh, placements, skip_offset=True)[0]
    )


def has_kernel(op: Any, device: torch.device) -> bool:
    """Whether ``op`` has a kernel (not only a decomposition) for ``device``'s backend."""
    key = torch._C._dispatch_key_for_device(device.type)
    return torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key)


# ---------------------------------------------------------------------------------------------
# Collectives inside an op's kernel (expert_dispatch.py)
# ---------------------------------------------------------------------------------------------


def group_rank_size(group_name: str) -> tuple[int, int]:
    """(this rank's index, size) of the process group registered as ``group_name``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    return pg.rank(), pg.size()


def all_to_all(t: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group_name: str) -> torch.Tensor:
    """All-to-all of ``t``'s rows (``input_splits[i]`` rows to rank i of the group,
    ``output_splits[i]`` from it), differentiable (the backward sends the gradients back
    with the splits swapped); waits for the result."""
    from torch.distributed import _functional_collectives as fc

    out = fc.all_to_all_single_autograd(t.contiguous(), output_splits, input_splits, group_name)
    return fc.wait_tensor(out)


def flatten_mesh_dims(mesh: Any, names: Sequence[str]) -> None:
    """Create the 1-D mesh over ``mesh``'s dims ``names`` (one process group per set of
    their ranks), named ``"_".join(names)``; every rank of the world calls it together."""
    mesh[tuple(names)]._flatten("_".join(names))


def group_ranks(group_name: str) -> tuple[int, ...]:
    """The global ranks of the process group registered as ``group_name``, in group order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))


def flattened_group_names(mesh: Any) -> list[str]:
    """This rank's process groups of every flattened mesh made on ``mesh``'s root mesh."""
    return [m.get_group().group_name
            for m in mesh._get_root_mesh()._flatten_mapping.values()]


def flattened_group_name(mesh: Any, names: Sequence[str]) -> str | None:
    """The process group of this rank over ``mesh``'s dims ``names`` taken together (made
    by :func:`flatten_mesh_dims` on its root mesh), or None when it was not made."""
    flat = mesh._get_root_mesh()._flatten_mapping.get("_".join(names))
    return None if flat is None else flat.get_group().group_name
