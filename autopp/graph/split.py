"""Split a stage's joint forward+backward graph into the callables a pipeline schedule runs.

Reuses torchtitan's graph_pp passes (see ``_compat``) for the graph surgery; this module
checks the input, chains the passes in schedule order and turns their per-pass metadata
into one :class:`CallingConvention`.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopp._compat import graph as _compat
from autopp.graph.callables import StageGraphs, ValueLayouts
from autopp.graph.convention import CallingConvention, JointSignature
from autopp.graph.peel import peel_param_work
from autopp.graph.reduce_grad import reduce_grad_split_point
from autopp.graph.recompute import check_recompute, Recompute, recompute_in_backward


def _outputs(gm: fx.GraphModule) -> tuple[object, ...]:
    (out,) = gm.graph.find_nodes(op="output")
    vals = out.args[0]
    return tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)


def check_joint_graph(gm: fx.GraphModule, signature: JointSignature) -> None:
    """Raise ``ValueError`` if ``gm`` does not have the layout ``signature`` describes."""
    if not isinstance(gm, fx.GraphModule):
        raise ValueError(f"expected a torch.fx.GraphModule joint graph, got {type(gm).__name__}")
    n_in = len(gm.graph.find_nodes(op="placeholder"))
    outs = _outputs(gm)
    if len(outs) <= signature.num_outputs:
        raise ValueError(
            f"the graph has no backward: it has {len(outs)} outputs and num_outputs="
            f"{signature.num_outputs}, so no gradient outputs. Trace a joint forward+backward "
            "graph (e.g. autopp.graph.trace_stage, or make_fx of a function that calls "
            "torch.autograd.grad) whose outputs are the stage outputs, then the param grads, "
            "then the input grads."
        )
    if n_in != signature.num_graph_inputs:
        raise ValueError(
            f"the joint graph has {n_in} inputs but the signature describes "
            f"{signature.num_graph_inputs} (params {signature.num_params} + buffers "
            f"{signature.num_buffers} + user inputs {signature.num_user_inputs} + output grads "
            f"{signature.num_output_grads}); fix the JointSignature counts."
        )
    if len(outs) != signature.num_graph_outputs:
        raise ValueError(
            f"the joint graph has {len(outs)} outputs but the signature describes "
            f"{signature.num_graph_outputs} (outputs {signature.num_outputs} + param grads "
            f"{signature.num_param_grads} + input grads {signature.num_input_grads}); fix the "
            "JointSignature counts."
        )
    grads = outs[signature.num_outputs:]
    if all(not isinstance(g, fx.Node) for g in grads):
        raise ValueError(
            "the graph has no backward: all its gradient outputs are constants (None); make "
            "sure the stage's parameters require grad and its outputs depend on them."
        )


def split_joint_graph(
    gm: fx.GraphModule,
    signature: JointSignature,
    *,
    layouts: ValueLayouts | None = None,
    split_weight_grad: bool = True,
    peel_params: bool = False,
    recompute: Recompute = "none",
) -> StageGraphs:
    """Split a flat joint forward+backward graph into the stage's callables.

    Args:
        gm: the joint graph, inputs ``params, buffers, user_inputs, output_grads`` and outputs
            ``forward_outputs, param_grads, input_grads`` (flat tensors).
        signature: the counts of each of those groups.
        layouts: how to rewrap outputs and grads into tensor subclasses; plain by default.
        split_weight_grad: also build backward-input / backward-weight (zero-bubble schedules).
        peel_params: move all parameter-only work into the unshard graph
            (:mod:`autopp.graph.peel`); default: peel SimpleFSDP's all-gather chains only.
        recompute: ``"none"``, ``"selective"`` or ``"full"`` (:mod:`autopp.graph.recompute`).

    Returns StageGraphs (forward, full backward and, where present, I, W, unshard and
    reduce-grad). Raises ValueError when the graph does not match ``signature`` or has no
    backward."""
    check_joint_graph(gm, signature)
    check_recompute(recompute)
    # SimpleFSDP's chain dedup is only sound for SimpleFSDP graphs; peel_params is for others
    gm = _compat.normalize_joint_graph(gm, dedup_unshard_chains=not peel_params)
    if peel_params:
        return _split_peeled(gm, signature, layouts, split_weight_grad, recompute)
    return _split(gm, signature, layouts, split_weight_grad, recompute)


def _split(gm: fx.GraphModule, signature: JointSignature, layouts: ValueLayouts | None,
           split_weight_grad: bool, recompute: Recompute,
           backward_only_extra: tuple[int, ...] = ()) -> StageGraphs:
    """Recompute rewrite, partition, peel SimpleFSDP collectives, split I/W.
    ``backward_only_extra``: more placeholder indices (before the output grads) that only
    the backward reads; the runtime supplies them ahead of the output grads (see
    ``CallingConvention``)."""
    gm = recompute_in_backward(gm, signature, recompute)
    fw, bw, meta = _compat.partition_joint_graph(
        gm,
        num_fwd_outputs=signature.num_outputs,
        backward_only_input_indices=(*backward_only_extra, *signature.output_grad_input_indices),
    )
    fsdp_fw = _compat.split_forward_fsdp_collectives(
        fw,
        num_params=signature.num_params,
        fwd_input_names=meta.fwd_input_names,
        fwd_flat_input_indices=meta.fwd_flat_input_indices,
    )
    fsdp_bw = _compat.split_backward_fsdp_collectives(
        bw, num_param_grads=signature.num_param_grads, split_point=reduce_grad_split_point)
    didw = None
    if split_weight_grad and signature.num_input_grads:
        didw = _compat.split_di_dw_graph(
            fsdp_bw.bw_no_fsdp_module, num_param_grads=signature.num_param_grads
        )
        if didw is not None and didw.num_input_grads != signature.num_input_grads:
            raise ValueError(
                f"backward-input graph returns {didw.num_input_grads} input grads, the "
                f"signature says {signature.num_input_grads}"
            )

    saved = meta.saved_for_backward_names
    grad_names = meta.backward_grad_input_names
    by_name = dict(zip(grad_names, meta.backward_grad_input_indices, strict=True))
    if meta.bwd_input_names != (*saved, *grad_names):
        raise ValueError(f"unexpected backward inputs {meta.bwd_input_names}")
    reduce_inputs: tuple[int, ...] = ()
    if fsdp_bw.reduce_grad_module is not None:
        names = list(fsdp_bw.bw_no_fsdp_output_names[: signature.num_param_grads])
        reduce_inputs = tuple(names.index(n) for n in fsdp_bw.reduce_grad_input_names)

    convention = CallingConvention(
        signature=signature,
        saved_for_backward=tuple(saved),
        backward_inputs=tuple(meta.bwd_input_names),
        output_grad_inputs=tuple(by_name[n] for n in grad_names),
        num_unsharded_params=fsdp_fw.num_fw_unsharded_param_inputs,
        forward_input_indices=tuple(fsdp_fw.fw_no_fsdp_flat_input_indices),
        unshard_param_indices=tuple(fsdp_fw.unshard_flat_param_indices),
        reduce_grad_inputs=reduce_inputs,
        num_weight_live_ins=0 if didw is None else len(didw.bw_dw_input_names),
        recompute=recompute,
    )
    return StageGraphs(
        forward_graph=fsdp_fw.fw_no_fsdp_module,
        full_backward_graph=fsdp_bw.bw_no_fsdp_module,
        convention=convention,
        layouts=layouts or ValueLayouts.plain(
            signature.num_outputs, signature.num_param_grads, signature.num_input_grads
        ),
        backward_input_graph=None if didw is None else didw.bw_di_module,
        backward_weight_graph=None if didw is None else didw.bw_dw_module,
        unshard_graph=fsdp_fw.unshard_module,
        reduce_grad_graph=fsdp_bw.reduce_grad_module,
    )


def _split_peeled(gm: fx.GraphModule, signature: JointSignature, layouts: ValueLayouts | None,
                  split_weight_grad: bool, recompute: Recompute) -> StageGraphs:
    """``split_joint_graph(..., peel_params=True)``: the parameter-only work becomes the
    unshard graph; the rest is split with the unshard outputs in the place of the
    parameters (handed to the torchtitan passes as buffers, so they peel nothing more).
    Unshard outputs the forward reads lead the forward's inputs; those only the backward
    reads (e.g. a weight gathered transposed for the input gradient) are handed to the
    backward with the saved values, by reference."""
    peeled = peel_param_work(gm, signature)
    n_f, n_fwd = peeled.num_frontier, peeled.num_forward_frontier
    rest_sig = dataclasses.replace(
        signature, num_params=0, num_buffers=n_f + signature.num_buffers)
    graphs = _split(peeled.rest, rest_sig, layouts, split_weight_grad, recompute,
                    backward_only_extra=tuple(range(n_fwd, n_f)))
    conv = graphs.convention
    fwd = list(conv.forward_input_indices)
    if fwd[:n_fwd] != list(range(n_fwd)) or any(i < n_f for i in fwd[n_fwd:]):
        raise ValueError(
            "the forward graph does not take the forward's unsharded parameter values as its "
            f"leading inputs (inputs {fwd[:n_fwd]}); split without peel_params"
        )
    shift = signature.num_params - n_f  # rest's flat [frontier, buffers, user inputs] -> ours
    graphs.convention = dataclasses.replace(
        conv,
        signature=signature,
        num_unsharded_params=n_fwd,
        num_backward_unsharded=n_f - n_fwd,
        forward_input_indices=tuple(i + shift for i in fwd[n_fwd:]),
        unshard_param_indices=peeled.param_indices,
    )
    graphs.unshard_graph = peeled.unshard
    return graphs
