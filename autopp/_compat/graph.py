"""The one place where autopp.graph touches private torch / experimental torchtitan APIs.

Everything imported here is private to torch (``_PipelineScheduleRuntime``, ``_Action``, the
FX partitioner helpers) or lives under torchtitan's ``graph_trainer.graph_pp``; an upgrade
of either library should only need changes in this file. Reused from graph_pp, rather than
written again: ``partition_joint_graph`` (joint graph -> forward / backward + saved values),
``split_di_dw_graph`` (backward -> dI / dW), the SimpleFSDP collective splits (unshard /
reduce-grad; the backward one with autopp's choice of where each reduction starts,
:mod:`autopp.graph.reduce_grad`, swapped into the pass's module for the call),
``GraphPipelineStage`` / ``GraphPipelineRuntime`` (action handlers for torch's runtime),
``minimal_fx_tracer`` (make_fx with DTensors unwrapped, and the layouts to rewrap them), the
graph cleanup passes, and ``is_mutation_node`` with torch's ``compute_intensive_ops`` for
activation recomputation (:mod:`autopp.graph.recompute`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import (  # noqa: F401  (torch private pytree)
    TreeSpec,
    tree_flatten,
    tree_leaves,
    tree_map_only,
    tree_unflatten,
)

# torch private: pipelining runtime IR -------------------------------------------------
from torch.distributed.pipelining.schedules import (  # noqa: F401
    _Action,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
)

# torchtitan experimental: graph_pp ----------------------------------------------------
from torchtitan.experiments.graph_trainer.fsdp_passes import (
    deduplicate_fsdp_unshard_chains_pass,
)
from torchtitan.experiments.graph_trainer.graph_pp.partition import (  # noqa: F401
    GraphMeta,
    partition_joint_graph as _tt_partition_joint_graph,
)
from torchtitan.experiments.graph_trainer.graph_pp.runner import (  # noqa: F401
    GraphPipelineRuntime,
    _scale_graph_pp_sharded_grads as scale_sharded_grads,
)
from torchtitan.experiments.graph_trainer.graph_pp.split_di_dw import (  # noqa: F401
    GraphPPDiDwSplit,
    split_di_dw_graph as _tt_split_di_dw_graph,
)
from torchtitan.experiments.graph_trainer.graph_pp import (
    split_fsdp_collectives as _tt_split_fsdp,
)
from torchtitan.experiments.graph_trainer.graph_pp.split_fsdp_collectives import (  # noqa: F401
    split_forward_fsdp_collectives,
)
from torchtitan.experiments.graph_trainer.graph_pp.stage import (  # noqa: F401
    GraphPipelineStage as _TTGraphPipelineStage,
    GraphPPStageRuntimeState as _TTStageState,
)
from torchtitan.experiments.graph_trainer.graph_pp.utils import (  # noqa: F401
    flatten_graph_values,
    graph_pp_value_spec,
    GraphPPValueSpec,
    is_mutation_node,
    overlap_fw_bw_sub_actions,
)
from torchtitan.experiments.graph_trainer.make_fx_tracer import (  # noqa: F401
    minimal_fx_tracer,
    TracedResult,
)
from torchtitan.experiments.graph_trainer.remove_noop_passes import (
    canonicalize_graph_pass,
    eliminate_dead_code_pass,
)


def _stage_takes_get_mesh() -> bool:
    import inspect

    from torch.distributed.pipelining.stage import PipelineStage

    return "get_mesh" in inspect.signature(PipelineStage.__init__).parameters


if _stage_takes_get_mesh():
    GraphPipelineStage = _TTGraphPipelineStage
else:
    class GraphPipelineStage(_TTGraphPipelineStage):  # type: ignore[no-redef]
        """torchtitan 0.3.0's graph stage on a torch whose ``PipelineStage`` has no
        ``get_mesh`` (torch 2.11, the GPU machine's): torchtitan's ``__init__`` passes it
        through, so this one calls ``PipelineStage.__init__`` without it and sets the state
        torchtitan's ``__init__`` sets (and ``_runtime_validate``, which torchtitan's runtime
        reads and torch 2.13's stage sets). autopp's stages exchange local tensors (never
        DTensors), so the mesh callback is not needed there."""

        def __init__(self, submodule, *, stage_index, num_stages, device, input_args=None,
                     output_args=None, group=None, get_mesh=None) -> None:
            from torch.distributed.pipelining.stage import PipelineStage

            if get_mesh is not None:
                raise NotImplementedError(
                    f"torch {torch.__version__}'s PipelineStage takes no get_mesh "
                    "(DTensors between stages need torch >= 2.13)")
            PipelineStage.__init__(self, submodule, stage_index, num_stages, device,
                                   input_args=input_args, output_args=output_args,
                                   group=group)
            self.graphs = None
            self.state = _TTStageState()
            self.saved_values_for_backward_weight_cache = {}
            self._graph_pp_grads_scaled = False
            # torchtitan's runtime reads this flag, which torch 2.13's stage sets
            self._runtime_validate = (torch.distributed.get_debug_level()
                                      == torch.distributed.DebugLevel.DETAIL)

        def _get_init_p2p_neighbors_ops(self):
            # torch 2.11 warms up the links to both neighbour stages by send/recv, also when
            # the neighbour is on this rank (two stages of a V schedule on one rank), which
            # gloo refuses; torch 2.13 skips them. The runtime hands those over in memory.
            me = torch.distributed.get_rank(self.group)
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]


RUNTIME_ACTIONS = (
    FORWARD,
    FULL_BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    UNSHARD,
    RESHARD,
    REDUCE_GRAD,
    OVERLAP_F_B,
)


_SPLIT_POINT_LOCK = threading.Lock()


def split_backward_fsdp_collectives(
    bw: fx.GraphModule, *, num_param_grads: int,
    split_point: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """torchtitan's backward split (reduce-grad epilogues peeled off the backward), with
    each parameter gradient's split point chosen by ``split_point(grad_output,
    torchtitan_point)`` where given (``torchtitan_point``: the input of the earliest
    reduce-scatter / all-reduce of the gradient's unary tail, or None). torchtitan's pass
    looks its finder up in its module, so the finder is swapped there for the call (under a
    lock: the swap is process-wide)."""
    if split_point is None:
        return _tt_split_fsdp.split_backward_fsdp_collectives(bw, num_param_grads=num_param_grads)
    with _SPLIT_POINT_LOCK:
        original = _tt_split_fsdp.find_fsdp_reduce_grad_input

        def find(grad_output: Any) -> Any:
            return split_point(grad_output, original(grad_output))

        _tt_split_fsdp.find_fsdp_reduce_grad_input = find
        try:
            return _tt_split_fsdp.split_backward_fsdp_collectives(
                bw, num_param_grads=num_param_grads)
        finally:
            _tt_split_fsdp.find_fsdp_reduce_grad_input = original


class _GraphOnly:
    """The one attribute of torchtitan's ``TracedResult`` that partitioning reads."""

    __slots__ = ("gm",)

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm


def partition_joint_graph(
    gm: fx.GraphModule, *, num_fwd_outputs: int, backward_only_input_indices: tuple[int, ...]
) -> tuple[fx.GraphModule, fx.GraphModule, GraphMeta]:
    """torchtitan's partitioner on a bare joint graph (it only reads ``.gm``)."""
    return _tt_partition_joint_graph(
        _GraphOnly(gm),  # type: ignore[arg-type]
        num_fwd_outputs=num_fwd_outputs,
        backward_only_input_indices=backward_only_input_indices,
    )


def normalize_joint_graph(gm: fx.GraphModule, *, dedup_unshard_chains: bool = True
                          ) -> fx.GraphModule:
    """Dead-code elimination, no-op removal and (``dedup_unshard_chains``) SimpleFSDP
    unshard-chain dedup. The dedup assumes every all-gather chain from one parameter yields
    the same value, true of SimpleFSDP and false of planned graphs (a weight gathered as
    ``w`` and as ``t(w)``: it would feed the transposed weight where the other is used)."""
    passes = [eliminate_dead_code_pass, canonicalize_graph_pass]
    if dedup_unshard_chains:
        passes.append(deduplicate_fsdp_unshard_chains_pass)
    for p in passes:
        gm = p(gm, None)
    return gm


@functools.cache
def compute_intensive_ops() -> frozenset[Any]:
    """The op packets torch's min-cut partitioner never recomputes (mm, bmm, addmm,
    convolution, flash / efficient attention, ...)."""
    from torch._functorch.partitioners import get_default_op_list

    return frozenset(get_default_op_list().compute_intensive_ops)


def is_op_overload(target: Any) -> bool:
    """Whether an FX call target is a torch operator overload (``aten.mm.default``)."""
    return isinstance(target, torch._ops.OpOverload)


def op_schema(op: Any) -> Any:
    """An OpOverload's ``FunctionSchema``."""
    return op._schema


def functional_form(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """The out-of-place equivalent of an in-place aten call ``op(*args, **kwargs)``:
    ``(op, args, kwargs)`` of the overload with the same arguments (``add_.Scalar`` ->
    ``add.Scalar``, ``bernoulli_.float`` -> ``bernoulli.p``), the in-place op's defaults
    spelled out; None when there is none."""
    if not is_op_overload(op) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    if packet is None or name.startswith("_"):
        return None

    def sig(schema: Any) -> list[tuple[str, str, bool]]:
        return [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]

    want = sig(op._schema)
    fn = next((getattr(packet, o) for o in packet.overloads()
               if not getattr(packet, o)._schema.is_mutable
               and sig(getattr(packet, o)._schema) == want), None)
    if fn is None:
        return None
    args, kwargs = list(args), dict(kwargs)
    for i, a in enumerate(op._schema.arguments):
        given = i < len(args) or a.name in kwargs
        if not given and a.has_default_value():
            if a.kwarg_only:
                kwargs[a.name] = a.default_value
            elif i == len(args):
                args.append(a.default_value)
    return fn, tuple(args), kwargs


def is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def is_runtime_schedule(schedule: Any) -> bool:
    return isinstance(schedule, _PipelineScheduleRuntime)


def inductor_compile(gm: fx.GraphModule, options: dict[str, Any] | None = None) -> Any:
    """Compile one flat FX callable with Inductor (static shapes, whole graph); ``options``
    are Inductor config keys for this compilation. A lazy graph module (see
    :func:`lazy_graph_modules`) gets its Python code first: dynamo does not trace through
    the lazy module's first-call hook."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
    return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False,
                         options=options or None)


def aot_descriptor_kinds(gm: fx.GraphModule) -> tuple[list[str], list[tuple[str, str | None]]]:
    """AOTAutograd descriptors of a joint graph as class names (input kinds; output kind
    with, for gradients, the kind of input they are the gradient of)."""
    ins = [type(n.meta.get("desc")).__name__ for n in gm.graph.find_nodes(op="placeholder")]
    (out,) = gm.graph.find_nodes(op="output")
    outs = []
    for d in tree_leaves(out.meta.get("desc", [])):
        grad_of = getattr(d, "grad_of", None)
        outs.append((type(d).__name__, None if grad_of is None else type(grad_of).__name__))
    return ins, outs


def use_flat_codegen(gm: fx.GraphModule) -> None:
    """Make ``gm`` take and return flat values (drop AOTAutograd's pytree codegen)."""
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()


def lazy_graph_modules() -> Any:
    """A context in which the graph modules torch's FX passes make defer their Python code
    until it is read or run (torch's ``_LazyGraphModule``): for graphs that are only walked,
    never called (the estimates' lowered graphs), the code generation of every pass's
    ``recompile`` is skipped."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def graph_module(root: Any, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``, lazy (no Python code until it is read or run) inside
    :func:`lazy_graph_modules`, so that the passes' own ``recompile`` calls on it are too."""
    from torch.fx._lazy_graph_module import _make_graph_module

    return _make_graph_module(root, graph)


def local_shard(t: Any) -> Any:
    """A DTensor's local shard (its inner tensor); other values as they are."""
    return t.to_local() if is_dtensor(t) else t


def like_param(local: torch.Tensor, param: Any) -> torch.Tensor:
    """A local gradient as the parameter's type: a DTensor with the parameter's mesh,
    placements and global shape when the parameter is one; else the tensor itself."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a runtime schedule holds on this rank."""
    return list(schedule._stages)


_SPLIT_LOCK = threading.Lock()


def split_di_dw_graph(bw_module: fx.GraphModule, *, num_param_grads: int
                      ) -> GraphPPDiDwSplit | None:
    """torchtitan's backward-input / backward-weight split, with the collectives only the
    weight gradients need left in the backward-weight graph.

    torchtitan's split copies into the input-gradient graph every node its inputs allow
    and then removes the unused ones by dead-code elimination, which keeps side-effecting
    nodes; torch lists ``_c10d_functional.wait_tensor`` as one, so every collective of the
    backward, and the chain that feeds it, stayed in I, and W held their results from I
    to W (e.g. a weight gradient's inputs gathered over dp and tp), which the planner's
    memory row, counting what W's own nodes read, did not count. During the split, ``wait_tensor`` is treated as pure, so I keeps only the
    collectives the input gradients need; W, extracted from what it needs, runs the rest.
    Both graphs keep each collective with its wait (a wait is never dropped while its
    result is used)."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
    from torch.fx import node as fx_node

    wait = torch.ops._c10d_functional.wait_tensor.default
    with _SPLIT_LOCK:
        had = wait in fx_node._side_effectful_functions
        fx_node._side_effectful_functions.discard(wait)
        try:
            return _tt_split_di_dw_graph(bw_module, num_param_grads=num_param_grads)
        finally:
            if had:
                fx_node._side_effectful_functions.add(wait)
