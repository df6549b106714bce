"""Run a planned unit by interpreting its joint graph on DTensors (the reference).

Before each op its tensor arguments are redistributed to the placements the plan requires
and after it the result moves to the planned output placement, so the collectives are the
plan's. An op that communicates inside its kernel (:mod:`op_hooks`) runs on local shards.
Gradients leave in their parameter's placement, the input gradient in the input's. The
backward re-runs the joint graph with the incoming gradient as tangent: simple and exact,
at the cost of a second forward.

:mod:`autopp.lower.local_graphs` traces this into a local graph with explicit collectives;
calling a ``ShardedStage`` eagerly runs it directly, the slower reference tests compare
against."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from autopp._compat import sharding as compat
from autopp.sharding.options import op_hooks
from autopp.graph.walk import closure
from autopp.sharding.plan import BlockPlan, from_strs, to_strs
from autopp.sharding.options.strategies import Option, tensor_vals
from autopp.tracing.joint import JointGraph


def redistribute_to(x: Any, placements: tuple | None) -> Any:
    """Redistribute ``x`` to ``placements``. Where the plan says ``Partial`` the value stays as
    DTensor holds it (the same values; DTensor forbids redistributing *to* a Partial)."""
    if not isinstance(x, DTensor) or placements is None:
        return x
    have = tuple(x.placements)
    target = tuple(h if isinstance(p, compat.Partial) else p for p, h in zip(placements, have))
    return x if target == have else x.redistribute(x.device_mesh, target)


def local_in(value: Any, placements: tuple) -> torch.Tensor:
    """``value`` (a DTensor) redistributed to ``placements`` (none Partial), as a local
    tensor: how a lowered graph returns a value in a planned placement."""
    if any(isinstance(p, compat.Partial) for p in placements):
        raise ValueError(f"graph outputs cannot be returned Partial, planned {to_strs(placements)}")
    out = redistribute_to(value, tuple(placements))
    if isinstance(out, DTensor):
        if tuple(out.placements) != tuple(placements):
            raise AssertionError(f"{out.placements} != {placements}")
        return out.to_local()
    return out


class GraphRunner:
    """Executes one joint graph on DTensors following a :class:`BlockPlan`."""

    def __init__(self, joint: JointGraph, block: BlockPlan, mesh, device: torch.device):
        self.joint, self.mesh, self.device = joint, mesh, device
        self.outs: dict[str, tuple] = {}
        self.ins: dict[str, tuple] = {}
        for name, outs, ins in block.nodes:
            self.outs[name] = tuple(from_strs(o) if o is not None else None for o in outs)
            self.ins[name] = tuple(from_strs(i) for i in ins)
        # the forward computes the outputs and the buffers it writes in place
        self.fwd_needed = self.ancestors(
            [*joint.outputs.values(), *joint.buffer_updates.values()])

    def buffer_updates(self, env: dict[fx.Node, Any]) -> list[tuple[fx.Node, DTensor]]:
        """(buffer placeholder, its new value in the buffer's placement) for each buffer the
        forward writes (the caller copies the value in)."""
        j = self.joint
        return [(j.buffers[f], redistribute_to(env[n], self.placement(j.buffers[f])))
                for f, n in j.buffer_updates.items()]

    def ancestors(self, roots: list[fx.Node]) -> set[fx.Node]:
        return closure(roots)

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
                    return redistribute_to(v, next(need, None))
                return v
            return a

        args = fx.node.map_arg(node.args, arg)
        kwargs = dict(fx.node.map_arg(node.kwargs, arg))
        if "device" in kwargs:
            kwargs["device"] = self.device
        if not has_tensor_arg:  # factory op (e.g. a causal mask): replicated everywhere
            t = node.target(*args, **kwargs)
            return DTensor.from_local(t, self.mesh, [compat.Replicate()] * self.mesh.ndim,
                                      run_check=False)
        if not (compat.has_rule(node.target) or compat.has_decomp_rule(node.target)):
            # planned as a replicated fallback: run on full tensors
            local = compat.tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v,
                               (args, kwargs))
            out = node.target(*local[0], **local[1])
            return compat.tree_map(
                lambda t: DTensor.from_local(t, self.mesh, [compat.Replicate()] * self.mesh.ndim,
                                             run_check=False)
                if isinstance(t, torch.Tensor) else t,
                out,
            )
        local_call = self._local_call(node)
        if local_call is not None:
            return self._run_local(node, local_call, args, kwargs)
        try:
            out = node.target(*args, **kwargs)
        except NotImplementedError:
            decomp = compat.decomposition(node.target)  # e.g. a fused kernel this backend lacks
            if decomp is None:
                raise
            out = decomp(*args, **kwargs)
        planned = self.outs.get(node.name)
        if isinstance(out, DTensor) and planned:
            out = redistribute_to(out, planned[0])
        return out

    def _local_call(self, node: fx.Node):
        """The function of local shards an op with :mod:`op_hooks` runs as planned, if any."""
        hooks = op_hooks.hooks_of(node.target)
        if hooks is None or node.name not in self.ins:
            return None
        return hooks.local_call(node, Option(self.outs[node.name], self.ins[node.name]),
                                self.mesh)

    def _run_local(self, node: fx.Node, fn, args, kwargs) -> Any:
        """Run ``fn`` on the local shards of the (already redistributed) arguments and wrap
        each result in its planned output placement."""
        local = compat.tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v,
                            (args, kwargs))
        out = fn(*local[0], **local[1])
        vals = tensor_vals(node)
        single = isinstance(node.meta.get("val"), torch.Tensor)
        outs = [out] if single else list(out)
        wrapped = [DTensor.from_local(t, self.mesh, pl, run_check=False, shape=v.shape,
                                      stride=v.stride())
                   for t, pl, v in zip(outs, self.outs[node.name], vals)]
        return wrapped[0] if single else tuple(wrapped)


class InterpretedBlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: GraphRunner, names: list[str], x: DTensor, *state: DTensor):
        j = runner.joint
        env: dict[fx.Node, Any] = {j.inputs[0]: redistribute_to(x, runner.placement(j.inputs[0]))}
        env.update(zip([*j.params.values(), *j.buffers.values()], state))
        env = runner.run(env, runner.fwd_needed)
        for bnode, value in runner.buffer_updates(env):
            env[bnode].copy_(value)
        ctx.runner = runner
        ctx.save_for_backward(x, *state)
        out = env[j.outputs[0]]
        return redistribute_to(out, runner.placement(j.tangents[0]))

    @staticmethod
    def backward(ctx, grad_out: DTensor):
        runner: GraphRunner = ctx.runner
        j = runner.joint
        x, *state = ctx.saved_tensors
        env: dict[fx.Node, Any] = {j.inputs[0]: redistribute_to(x, runner.placement(j.inputs[0]))}
        env.update(zip([*j.params.values(), *j.buffers.values()], state))
        env[j.tangents[0]] = redistribute_to(grad_out, runner.placement(j.tangents[0]))
        env = runner.run(env, None)
        grads = []
        for fqn, pnode in j.params.items():
            g = env.get(j.grads[fqn]) if fqn in j.grads else None
            grads.append(redistribute_to(g, runner.placement(pnode)) if g is not None else None)
        grads += [None] * len(j.buffers)
        gx = env.get(j.input_grads.get(0)) if 0 in j.input_grads else None
        gx = redistribute_to(gx, runner.placement(j.inputs[0])) if gx is not None else None
        return (None, None, gx, *grads)


