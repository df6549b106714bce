"""Turn a :class:`StagePlan` into a runnable sharded stage (first version: DTensor execution).

What runs: each planned unit (a block of a stack, or the whole stage) executes its traced joint
graph node by node on DTensors. Parameters and buffers are DTensors on the sub-mesh with the
planned placements; before each op its tensor arguments are redistributed to the placements
the plan requires, and after it the result is moved to the planned output placement, so the
collectives are the plan's (DTensor performs them). Gradients leave the graph redistributed to
their parameter's placement (the plan ties them), the input gradient to the input's.

The forward runs only the graph's forward nodes; the backward re-runs the joint graph with
the incoming gradient as tangent (activation recomputation: simple and exact, at the cost of
a second forward). A local graph with explicit collectives, which graph-level PP utilities
can split, is the next version.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopp.sharding import _torch_private as tp
from autopp.sharding.chain import Unit, stage_units
from autopp.sharding.plan import BlockPlan, StagePlan, from_strs
from autopp.sharding.trace import JointGraph, graph_signature, trace_joint


def _to(x: Any, placements: tuple | None) -> Any:
    """Redistribute ``x`` to ``placements``. Where the plan says ``Partial`` the value stays as
    DTensor holds it (the same values; DTensor forbids redistributing *to* a Partial)."""
    if not isinstance(x, DTensor) or placements is None:
        return x
    have = tuple(x.placements)
    target = tuple(h if isinstance(p, tp.Partial) else p for p, h in zip(placements, have))
    return x if target == have else x.redistribute(x.device_mesh, target)


class _GraphRunner:
    """Executes one joint graph on DTensors following a :class:`BlockPlan`."""

    def __init__(self, joint: JointGraph, block: BlockPlan, mesh, device: torch.device):
        self.joint, self.mesh, self.device = joint, mesh, device
        self.outs: dict[str, tuple] = {}
        self.ins: dict[str, tuple] = {}
        for name, outs, ins in block.nodes:
            self.outs[name] = tuple(from_strs(o) if o is not None else None for o in outs)
            self.ins[name] = tuple(from_strs(i) for i in ins)
        self.fwd_needed = self._ancestors(list(joint.outputs.values()))

    def _ancestors(self, roots: list[fx.Node]) -> set[fx.Node]:
        seen, stack = set(), list(roots)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack += n.all_input_nodes
        return seen

    def placement(self, node: fx.Node) -> tuple:
        return self.outs[node.name][0]

    def run(self, env: dict[fx.Node, Any], only: set[fx.Node] | None) -> dict[fx.Node, Any]:
        for node in self.joint.gm.graph.nodes:
            if node.op != "call_function" or (only is not None and node not in only):
                continue
            env[node] = self._call(node, env)
        return env

    def _call(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        if node.target is operator.getitem:
            return env[node.args[0]][node.args[1]]
        need = iter(self.ins.get(node.name, ()))
        has_tensor_arg = False

        def arg(a):
            nonlocal has_tensor_arg
            if isinstance(a, fx.Node):
                v = env[a]
                if isinstance(v, torch.Tensor):
                    has_tensor_arg = True
                    return _to(v, next(need, None))
                return v
            return a

        args = fx.node.map_arg(node.args, arg)
        kwargs = dict(fx.node.map_arg(node.kwargs, arg))
        if "device" in kwargs:
            kwargs["device"] = self.device
        if not has_tensor_arg:  # factory op (e.g. a causal mask): replicated everywhere
            t = node.target(*args, **kwargs)
            return DTensor.from_local(t, self.mesh, [tp.Replicate()] * self.mesh.ndim,
                                      run_check=False)
        if not (tp.has_rule(node.target) or tp.has_decomp_rule(node.target)):
            # planned as a replicated fallback: run on full tensors
            local = tp.tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v,
                               (args, kwargs))
            out = node.target(*local[0], **local[1])
            return tp.tree_map(
                lambda t: DTensor.from_local(t, self.mesh, [tp.Replicate()] * self.mesh.ndim,
                                             run_check=False)
                if isinstance(t, torch.Tensor) else t,
                out,
            )
        try:
            out = node.target(*args, **kwargs)
        except NotImplementedError:
            decomp = tp.decomposition(node.target)  # e.g. a fused kernel this backend lacks
            if decomp is None:
                raise
            out = decomp(*args, **kwargs)
        planned = self.outs.get(node.name)
        if isinstance(out, DTensor) and planned:
            out = _to(out, planned[0])
        return out


class _BlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: _GraphRunner, names: list[str], x: DTensor, *state: DTensor):
        j = runner.joint
        env: dict[fx.Node, Any] = {j.inputs[0]: _to(x, runner.placement(j.inputs[0]))}
        env.update(zip([*j.params.values(), *j.buffers.values()], state))
        env = runner.run(env, runner.fwd_needed)
        ctx.runner = runner
        ctx.save_for_backward(x, *state)
        out = env[j.outputs[0]]
        return _to(out, runner.placement(j.tangents[0]))

    @staticmethod
    def backward(ctx, grad_out: DTensor):
        runner: _GraphRunner = ctx.runner
        j = runner.joint
        x, *state = ctx.saved_tensors
        env: dict[fx.Node, Any] = {j.inputs[0]: _to(x, runner.placement(j.inputs[0]))}
        env.update(zip([*j.params.values(), *j.buffers.values()], state))
        env[j.tangents[0]] = _to(grad_out, runner.placement(j.tangents[0]))
        env = runner.run(env, None)
        grads = []
        for fqn, pnode in j.params.items():
            g = env.get(j.grads[fqn]) if fqn in j.grads else None
            grads.append(_to(g, runner.placement(pnode)) if g is not None else None)
        grads += [None] * len(j.buffers)
        gx = env.get(j.input_grads.get(0)) if 0 in j.input_grads else None
        gx = _to(gx, runner.placement(j.inputs[0])) if gx is not None else None
        return (None, None, gx, *grads)


class ShardedBlock(nn.Module):
    """One planned unit: its parameters and buffers as DTensors, its graph run by the plan."""

    def __init__(self, unit: Unit, joint: JointGraph, bplan: BlockPlan, mesh):
        super().__init__()
        device = next(iter(unit.module.parameters())).device
        self.unit = unit
        self._runner = _GraphRunner(joint, bplan, mesh, device)
        self._param_names, self._buffer_names, self._fqns = [], [], []
        self.params = nn.ParameterDict()
        for fqn, node in joint.params.items():
            t = unit.module.get_parameter(fqn)
            d = distribute_tensor(t.detach(), mesh, self._runner.placement(node))
            key = fqn.replace(".", "__")
            self.params[key] = nn.Parameter(d, requires_grad=t.requires_grad)
            self._param_names.append(key)
            self._fqns.append(unit.stage_fqn(fqn))
        for fqn, node in joint.buffers.items():
            t = unit.module.get_buffer(fqn)
            key = fqn.replace(".", "__")
            self.register_buffer(key, distribute_tensor(t, mesh, self._runner.placement(node)))
            self._buffer_names.append(key)

    def forward(self, x: DTensor) -> DTensor:
        state = [self.params[k] for k in self._param_names]
        state += [getattr(self, k) for k in self._buffer_names]
        return _BlockFunction.apply(self._runner, self._param_names, x, *state)


class ShardedStage(nn.Module):
    """The planned stage: takes and returns DTensors in the plan's input/output placements."""

    def __init__(self, blocks: list[tuple[str, ShardedBlock]], plan: StagePlan, mesh):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.blocks = nn.ModuleDict({p.replace(".", "__") or "stage": b for p, b in blocks})

    def forward(self, x: torch.Tensor) -> DTensor:
        if not isinstance(x, DTensor):  # a global tensor, identical on every rank
            x = distribute_tensor(x, self.mesh, from_strs(self.plan.input_placements))
        for block in self.blocks.values():
            x = block(x)
        return x

    def named_planned_parameters(self):
        """(stage FQN, DTensor parameter) pairs, FQNs as in the original module."""
        for block in self.blocks.values():
            for fqn, key in zip(block._fqns, block._param_names):
                yield fqn, block.params[key]


def apply_plan(
    module: nn.Module, plan: StagePlan, mesh, example_inputs: tuple[Any, ...]
) -> ShardedStage:
    """Shard ``module`` (materialised, identical on every rank) on ``mesh`` following ``plan``.

    ``example_inputs`` are the meta tensors the plan was made with (the graphs are re-traced on
    a meta copy to recover the planned nodes; their signatures must match the plan's). Every
    rank must hold the same plan: plan on one rank and broadcast it (``plan.to_json()``), since
    equally good optima may differ between solver runs.
    """
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise ValueError(f"plan is for mesh {plan.mesh_shape}, got {tuple(mesh.shape)}")
    flat = len(plan.blocks) == 1 and plan.blocks[0].prefix == ""
    units = [Unit("", module)] if flat else stage_units(module)
    if units is None:
        raise ValueError("the plan is per unit (blocks) but the module is not a block stack")
    by_name = {u.name: u for u in units}
    x = example_inputs[0]
    done: list[tuple[str, ShardedBlock]] = []
    traced: dict[str, JointGraph] = {}
    for bplan in plan.blocks:
        unit = by_name[bplan.prefix]
        if bplan.signature not in traced:
            args = example_inputs if flat else (x,)
            traced[bplan.signature] = trace_joint(_meta_copy(unit.module), args)
        joint = traced[bplan.signature]
        _check(joint, bplan)
        done.append((bplan.prefix, ShardedBlock(unit, joint, bplan, mesh)))
        out = joint.outputs[0].meta["val"]
        x = torch.empty(out.shape, dtype=out.dtype, device="meta")
    return ShardedStage(done, plan, mesh)


def _meta_copy(module: nn.Module) -> nn.Module:
    import copy

    if all(p.device.type == "meta" for p in module.parameters()):
        return module
    clone = copy.deepcopy(module)
    return clone.to_empty(device="meta")


def _check(joint: JointGraph, bplan: BlockPlan) -> None:
    if graph_signature(joint) != bplan.signature:
        raise ValueError(
            f"block {bplan.prefix or '<stage>'} traces to a different graph than the one "
            "planned: re-plan with the same module and example input shapes"
        )
