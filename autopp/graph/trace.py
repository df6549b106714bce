"""Trace a pipeline stage's joint forward+backward graph (make_fx, subclasses unwrapped).

Written here (not reused) because torchtitan's stage tracer is a private function bound to
its GraphTrainer runtime; the tracing engine itself, ``minimal_fx_tracer``, is reused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopp._compat import graph as _compat
from autopp.graph.callables import StageGraphs, ValueLayouts
from autopp.graph.convention import JointSignature
from autopp.graph.recompute import Recompute
from autopp.graph.split import split_joint_graph


@dataclasses.dataclass(frozen=True, slots=True)
class TracedStage:
    """A stage's joint graph with its signature and the metadata to build a pipeline stage."""

    graph: fx.GraphModule
    """Flat joint graph (see :class:`JointSignature` for its layout)."""
    signature: JointSignature
    """Counts of each input and output group of ``graph``."""
    layouts: ValueLayouts
    """How flat outputs and grads rewrap into the stage's values."""
    input_meta: tuple[torch.Tensor, ...]
    """Meta tensors shaped like one microbatch of the stage's positional inputs."""
    output_meta: tuple[torch.Tensor, ...]
    """Meta tensors shaped like the stage's outputs (the loss on the last stage)."""


def _meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if _compat.is_dtensor(t):
        t = t.to_local()
    m = torch.empty(t.shape, dtype=t.dtype, device="meta")
    # torch's stage allocates grad buffers only for values that require grad
    return m.requires_grad_(True) if m.is_floating_point() else m


def trace_stage(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    output_grads: Sequence[torch.Tensor] | None = None,
) -> TracedStage:
    """Trace ``module``'s forward and backward for one microbatch into one flat FX graph.

    Args:
        module: the stage module (plain, or with DTensor parameters); its trainable parameters
            get gradient outputs.
        args, kwargs: one microbatch of inputs. Floating tensors are differentiable activations
            (their grads go to the previous stage); integer tensors (tokens) are not.
        loss_fn: ``loss_fn(output, target) -> scalar``, given for the last stage only.
        target: one microbatch of the loss target (last stage only).
        output_grads: example output gradients (other stages); zeros by default.

    Raises ValueError when nothing requires grad or the last stage's loss is not a scalar."""
    kwargs = dict(kwargs or {})
    is_last = loss_fn is not None

    def _req(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().requires_grad_(True)
        return v

    stage_args = _compat.tree_map_only(torch.Tensor, _req, tuple(args))
    stage_kwargs = _compat.tree_map_only(torch.Tensor, _req, kwargs)
    params = [p for _, p in module.named_parameters(remove_duplicate=False)]
    buffers = [b for _, b in module.named_buffers(remove_duplicate=False)]
    grad_params_n = sum(p.requires_grad for p in params)
    user_leaves = _compat.tree_leaves((stage_args, stage_kwargs))
    if grad_params_n == 0 and not any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in user_leaves
    ):
        raise ValueError(
            "the stage has no backward: none of its parameters or inputs requires grad. "
            "Call module.requires_grad_(True) (and do not trace under torch.no_grad())."
        )

    def grad_targets(a: tuple[Any, ...], kw: dict[str, Any]) -> tuple[list, int]:
        ps = [p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
        xs = [v for v in _compat.tree_leaves((a, kw)) if isinstance(v, torch.Tensor) and v.requires_grad]
        return ps + xs, len(ps)

    def _grads(outs: list[torch.Tensor], gouts: Any, a: tuple, kw: dict) -> tuple[tuple, tuple]:
        targets, n = grad_targets(a, kw)
        gs = torch.autograd.grad(outs, targets, grad_outputs=gouts, allow_unused=True,
                                 materialize_grads=True)
        return tuple(gs[:n]), tuple(gs[n:])

    if is_last:
        def last_step(a, kw, tgt, loss_kwargs):
            loss = loss_fn(module(*a, **kw), tgt)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor for the last stage")
            pg, ig = _grads([loss], None, a, kw)
            return loss, pg, ig

        out_example = (torch.empty((), device="meta"),)
        traced = _compat.minimal_fx_tracer(last_step, module=module)(
            stage_args, stage_kwargs, target, {}
        )
        num_output_grads = 0
    else:
        if output_grads is None:
            with torch.no_grad():
                out = module(*args, **kwargs)
            output_grads = tuple(torch.zeros_like(o) for o in _compat.tree_leaves(out))
        output_grads = tuple(output_grads)

        def mid_step(a, kw, gouts):
            out = module(*a, **kw)
            flat = _compat.tree_leaves(out)
            if len(flat) != len(gouts):
                raise ValueError(f"the stage returns {len(flat)} tensors but {len(gouts)} "
                                 "output_grads were given; pass one grad per output")
            pg, ig = _grads(flat, list(gouts), a, kw)
            return out, pg, ig

        traced = _compat.minimal_fx_tracer(mid_step, module=module)(
            stage_args, stage_kwargs, output_grads
        )
        out_example = tuple(_meta(g) for g in output_grads)
        num_output_grads = len(_compat.flatten_graph_values(list(output_grads)))

    spec = traced.output_spec
    out_spec, pg_spec, ig_spec = spec.child(0), spec.child(1), spec.child(2)
    n_out, n_pg, n_ig = out_spec.num_leaves, pg_spec.num_leaves, ig_spec.num_leaves
    lay = traced.output_subclass_layouts
    layouts = ValueLayouts(
        outputs=_compat.graph_pp_value_spec(lay, start=0, count=n_out, tree_spec=out_spec),
        param_grads=_compat.graph_pp_value_spec(lay, start=n_out, count=n_pg),
        input_grads=_compat.graph_pp_value_spec(lay, start=n_out + n_pg, count=n_ig),
    )
    num_params = len(_compat.flatten_graph_values(params))
    num_buffers = len(_compat.flatten_graph_values(buffers))
    user_tree = (stage_args, stage_kwargs, target, {}) if is_last else (stage_args, stage_kwargs)
    user_flat = _compat.flatten_graph_values(_compat.tree_leaves((user_tree, {})))
    input_grad_indices = tuple(
        i for i, v in enumerate(user_flat) if isinstance(v, torch.Tensor) and v.requires_grad
    )
    signature = JointSignature(
        num_params=num_params,
        num_buffers=num_buffers,
        num_user_inputs=len(user_flat),
        num_output_grads=num_output_grads,
        num_outputs=layouts.outputs.num_flat_values,
        num_param_grads=layouts.param_grads.num_flat_values,
        input_grad_indices=input_grad_indices,
        is_last=is_last,
    )
    return TracedStage(
        graph=traced.gm,
        signature=signature,
        layouts=layouts,
        input_meta=tuple(_meta(a) for a in args),
        output_meta=out_example,
    )


def build_stage_graphs(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    output_grads: Sequence[torch.Tensor] | None = None,
    split_weight_grad: bool = True,
    recompute: Recompute = "none",
) -> StageGraphs:
    """Trace ``module`` (see :func:`trace_stage`) and split it (see :func:`split_joint_graph`,
    which ``split_weight_grad`` and ``recompute`` are passed to)."""
    traced = trace_stage(module, args, kwargs, loss_fn=loss_fn, target=target,
                         output_grads=output_grads)
    graphs = split_joint_graph(traced.graph, traced.signature, layouts=traced.layouts,
                               split_weight_grad=split_weight_grad, recompute=recompute)
    graphs.input_meta = traced.input_meta
    graphs.output_meta = traced.output_meta
    return graphs
