"""Turn a :class:`StagePlan` into a sharded stage.

Parameters and buffers become DTensors on the sub-mesh in the planned placements (sharded
from full values, or created shard by shard with :func:`empty_sharded_`). The stage runs as
graphs, what pipelines run (:meth:`ShardedStage.stage_graphs`: lowered to one local joint
graph, :func:`autopp.lower.local_graphs.lower_stage`, reused where lowered before, and split
by :mod:`autopp.graph`), or eagerly under autograd (``stage(x)``: the interpreter,
:mod:`autopp.lower.interpret`), the reference the lowering is traced from and tests compare
against."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopp import tracing
from autopp.graph.recompute import Recompute, check_recompute
from autopp._compat import sharding as compat
from autopp.tracing.units import Unit, stage_units
from autopp.lower.interpret import GraphRunner, InterpretedBlockFunction
from autopp.lower.local_graphs import (
    LocalJoint,
    LoweredUnit,
    lower_joint,
    split_local,
)
from autopp.lower.reuse import lowered_stage, split_stage
from autopp.sharding.plan import BlockPlan, StagePlan, from_strs
from autopp.tracing.precision import maybe_cast
from autopp.tracing.joint import JointGraph, graph_signature
from autopp.tracing.cache import plainest_by, traced_unit


class ShardedBlock(nn.Module):
    """One planned unit: its parameters and buffers as DTensors, its joint graph and plan."""

    def __init__(self, unit: Unit, joint: JointGraph, bplan: BlockPlan, mesh):
        super().__init__()
        device = next(iter(unit.module.parameters())).device
        self.unit = unit
        self._runner = GraphRunner(joint, bplan, mesh, device)
        self._param_names, self._buffer_names, self._fqns = [], [], []
        self._buffer_fqns: list[str] = []
        self.params = nn.ParameterDict()
        for fqn, node in joint.params.items():
            t = unit.module.get_parameter(fqn)
            pl = self._runner.placement(node)
            if isinstance(t, DTensor):  # sharded already (shard-by-shard init)
                if tuple(t.placements) != tuple(pl):
                    raise ValueError(f"{unit.stage_fqn(fqn)} is sharded as {t.placements}, "
                                     f"the plan says {pl}")
                d = t.detach()
            else:
                d = distribute_tensor(t.detach(), mesh, pl)
            key = fqn.replace(".", "__")
            self.params[key] = nn.Parameter(d, requires_grad=t.requires_grad)
            self._param_names.append(key)
            self._fqns.append(unit.stage_fqn(fqn))
        for fqn, node in joint.buffers.items():
            t = unit.module.get_buffer(fqn)
            key = fqn.replace(".", "__")
            self.register_buffer(key, distribute_tensor(t, mesh, self._runner.placement(node)))
            self._buffer_names.append(key)
            self._buffer_fqns.append(unit.stage_fqn(fqn))
        self.bplan = bplan

    def lowered_unit(self) -> LoweredUnit:
        """What :func:`~autopp.lower.local_graphs.lower_stage` needs of this unit."""
        return LoweredUnit(self._runner.joint, self.bplan, tuple(self._fqns),
                           tuple(self._buffer_fqns))

    def forward(self, x: DTensor) -> DTensor:
        params = [self.params[k] for k in self._param_names]
        state = params + [getattr(self, k) for k in self._buffer_names]
        return InterpretedBlockFunction.apply(self._runner, self._param_names, x, *state)


class ShardedStage(nn.Module):
    """The planned stage: takes and returns DTensors in the plan's input/output placements."""

    def __init__(self, blocks: list[tuple[str, ShardedBlock]], plan: StagePlan, mesh):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.blocks = nn.ModuleDict({p.replace(".", "__") or "stage": b for p, b in blocks})
        # what the backward pieces of stage_graphs() recompute unless told otherwise ("none",
        # "selective", "full"); the planner backend sets PlannerOptions.recompute here
        self.recompute: Recompute = "none"
        # whether stage_graphs() reorders its pieces for communication overlap (collectives
        # issued early, waited at first use); PlannerOptions.overlap_collectives sets it
        self.overlap_collectives: bool = True
        self._local: LocalJoint | None = None
        self._graphs: dict[str, Any] = {}  # split graphs by recompute mode

    def forward(self, x: torch.Tensor) -> DTensor:
        if not isinstance(x, DTensor):  # a global tensor, identical on every rank
            x = distribute_tensor(x, self.mesh, from_strs(self.plan.input_placements))
        for block in self.blocks.values():
            x = block(x)
        return x

    def stage_graphs(self, recompute: Recompute | None = None) -> tuple[LocalJoint, Any]:
        """The stage lowered to one local joint graph and split into its callables
        (:class:`autopp.graph.StageGraphs`); lowered once, split once per ``recompute`` mode
        (None: :attr:`recompute`, the mode the stage runs with), both cached.

        Graph inputs follow this module's ``parameters()`` and ``buffers()`` order (what
        :class:`autopp.graph.GraphStage` hands them in), then the stage input in the plan's
        input placements and the output gradient in its output placements. Parameter casts
        and all-gathers form the unshard graph (once per step); the backward pieces
        recompute per ``recompute``; every piece issues its collectives early and waits at
        first use unless :attr:`overlap_collectives` is False; see
        :func:`autopp.lower.local_graphs.split_local`.
        """
        mode = self.recompute if recompute is None else recompute
        check_recompute(mode)
        if self._local is None:
            self._local = lowered_stage(
                [b.lowered_unit() for b in self.blocks.values()], self.mesh,
                from_strs(self.plan.input_placements), from_strs(self.plan.output_placements))
        if mode not in self._graphs:
            self._graphs[mode] = split_stage(self._local, recompute=mode,
                                             overlap=self.overlap_collectives)
        return self._local, self._graphs[mode]

    def param_blocks(self) -> tuple[int, ...]:
        """The block (unit, in stage order) of each flat parameter, in the order
        :meth:`stage_graphs` takes them."""
        return tuple(k for k, b in enumerate(self.blocks.values()) for _ in b._param_names)

    def per_block_graphs(self, prefetch: int = 1, recompute: Recompute | None = None) -> Any:
        """:meth:`stage_graphs`' graphs rewritten to gather and reduce block by block
        (:func:`autopp.graph.per_block.per_block_stage_graphs`), cached per (recompute,
        prefetch)."""
        from autopp.graph.per_block import per_block_stage_graphs

        mode = self.recompute if recompute is None else recompute
        key = f"{mode}/per_block/{prefetch}"
        if key not in self._graphs:
            self._graphs[key] = per_block_stage_graphs(
                self.stage_graphs(mode)[1], self.param_blocks(), prefetch=prefetch,
                overlap=self.overlap_collectives)
        return self._graphs[key]

    def saved_bytes_per_microbatch(self) -> int:
        """Bytes this rank keeps from a microbatch's forward for its backward (activations;
        parameters gathered once per step are counted by :meth:`gathered_param_bytes`)."""
        from autopp.lower.memory import saved_bytes

        return saved_bytes(self.stage_graphs()[1])

    def gathered_param_bytes(self) -> int:
        """Bytes of the unshard graph's outputs that are not parameters themselves: the
        gathered (and cast) parameter values a stage holds once between UNSHARD and its
        last backward, whatever the number of microbatches."""
        from autopp.lower.memory import unsharded_bytes

        return unsharded_bytes(self.stage_graphs()[1])

    def named_planned_parameters(self):
        """(stage FQN, DTensor parameter) pairs, FQNs as in the original module."""
        for block in self.blocks.values():
            for fqn, key in zip(block._fqns, block._param_names):
                yield fqn, block.params[key]

    def named_planned_buffers(self):
        """(stage FQN, DTensor buffer) pairs: the buffers the stage's graphs read and write
        (e.g. a MoE layer's token counts and expert bias)."""
        for block in self.blocks.values():
            for fqn, key in zip(block._buffer_fqns, block._buffer_names):
                yield fqn, getattr(block, key)


def apply_plan(
    module: nn.Module, plan: StagePlan, mesh, example_inputs: tuple[Any, ...]
) -> ShardedStage:
    """Shard ``module`` on ``mesh`` following ``plan``.

    ``module`` is materialised, identical on every rank, or already holds DTensor parameters
    in the planned placements (see :func:`empty_sharded_`). ``example_inputs`` are the meta
    tensors the plan was made with (the graphs are re-traced on a meta copy to recover the
    planned nodes; their signatures must match the plan's). Every rank must hold the same
    plan: plan on one rank and broadcast it (``plan.to_json()``), since equally good optima
    may differ between solver runs. Run the result as graphs
    (:meth:`ShardedStage.stage_graphs`) or eagerly (the reference interpreter).
    """
    done: list[tuple[str, ShardedBlock]] = []
    for bplan, unit, joint, _ in planned_units(module, plan, mesh, example_inputs, lower=False):
        done.append((bplan.prefix, ShardedBlock(unit, joint, bplan, mesh)))
    return ShardedStage(done, plan, mesh)


def units_of_plan(module: nn.Module, plan: StagePlan, mesh, example: Any = None,
                  keyword: dict[str, torch.Tensor] | None = None
                  ) -> tuple[bool, dict[str, Unit]]:
    """``(flat, units by name)``: how ``plan`` sees ``module``: one flat unit (the plan has
    one block with no prefix) or its block stack (:func:`~autopp.tracing.units.stage_units`,
    with ``example`` the stage input and ``keyword`` the plan's keyword inputs). Raises when
    the mesh or the module does not fit."""
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise ValueError(f"plan is for mesh {plan.mesh_shape}, got {tuple(mesh.shape)}")
    flat = len(plan.blocks) == 1 and plan.blocks[0].prefix == ""
    units = [Unit("", module)] if flat else stage_units(module, example, keyword,
                                                        param_dtype=plan.param_dtype)
    if units is None:
        raise ValueError("the plan is per unit (blocks) but the module is not a block stack")
    return flat, {u.name: u for u in units}


def planned_units(
    module: nn.Module, plan: StagePlan, mesh, example_inputs: tuple[Any, ...], *, lower: bool
) -> Iterator[tuple[BlockPlan, Unit, JointGraph, tuple[Any, Any] | None]]:
    """Each planned unit of ``module`` with its re-traced joint graph and, with ``lower``,
    its lowered joint and split graphs (shared by units with the same plan)."""
    x = example_inputs[0]
    keyword = plan.keyword_examples()
    flat, by_name = units_of_plan(module, plan, mesh, x, keyword)
    traced: dict[str, JointGraph] = {}
    lowered: dict[tuple, tuple[Any, Any]] = {}
    # each signature traced on its plainest unit: the trace key its planning (and another
    # stage's or schedule's copies of the block) had; the stage's end blocks carry its cut
    plain = plainest_by((b.signature, by_name[b.prefix].module) for b in plan.blocks)
    for bplan in plan.blocks:
        unit = by_name[bplan.prefix]
        if bplan.signature not in traced:
            args = example_inputs if flat else (x, *keyword.values())
            with tracing.settings(plan.trace_settings):  # as the stage was planned
                traced[bplan.signature] = traced_unit(
                    plain[bplan.signature], args, param_dtype=plan.param_dtype,
                    prepare=lambda m: maybe_cast(_meta_copy(m), plan.param_dtype),
                    differentiable=None if flat else 1)
        joint = traced[bplan.signature]
        check_planned_graph(joint, bplan)
        low = None
        if lower:
            key = (bplan.signature, bplan.nodes)
            if key not in lowered:
                local = lower_joint(joint, bplan, mesh)
                lowered[key] = (local, split_local(local))
            low = lowered[key]
        yield bplan, unit, joint, low
        out = joint.outputs[0].meta["val"]
        x = torch.empty(out.shape, dtype=out.dtype, device="meta")


@torch.no_grad()
def empty_sharded_(module: nn.Module, plan: StagePlan, mesh, device: torch.device) -> nn.Module:
    """Replace ``module``'s parameters (e.g. on meta) by uninitialised DTensors in the planned
    placements, each holding only this rank's shard on ``device``; buffers are left alone.

    With :func:`autopp.init.init_module_` next, no full stage is ever materialised: each
    parameter's full value exists only while it is initialised and sharded.
    """
    placements = plan.param_placements()
    for fqn, p in list(module.named_parameters()):
        if fqn not in placements:
            raise ValueError(f"parameter {fqn} is not in the plan; plan this module again")
        pl = placements[fqn]
        local = torch.empty(compat.local_shape(p.shape, mesh, pl), dtype=p.dtype, device=device)
        d = DTensor.from_local(local, mesh, pl, run_check=False, shape=p.shape,
                               stride=torch.empty(p.shape, device="meta").stride())
        *path, leaf = fqn.split(".")
        owner = module.get_submodule(".".join(path)) if path else module
        owner.register_parameter(leaf, nn.Parameter(d, requires_grad=p.requires_grad))
    return module


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with plain meta parameters and buffers (what the planner traced)."""
    import copy

    if all(p.device.type == "meta" and not isinstance(p, DTensor) for p in module.parameters()):
        return module
    clone = copy.deepcopy(module)
    for mod in clone.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"),
                    requires_grad=p.requires_grad,
                )
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return clone


class PlanMismatchError(ValueError):
    """A plan's block traces to another graph than the one it was planned for (the model or
    its inputs changed under a plan read from a file or the plan cache)."""


def check_planned_graph(joint: JointGraph, bplan: BlockPlan) -> None:
    """Refuse a block plan whose graph is not ``joint``'s (:class:`PlanMismatchError`)."""
    if graph_signature(joint) != bplan.signature:
        raise PlanMismatchError(
            f"block {bplan.prefix or '<stage>'} traces to a different graph than the one "
            "planned: re-plan with the same module and example input shapes"
        )
