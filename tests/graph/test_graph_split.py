"""Each split callable equals the unsplit joint graph (llama3 blocks, fp32), and W defers work."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from graph_models import Blocks, build_llama, mse_loss

from autopp.graph import (
    JointSignature,
    StageGraphs,
    build_stage_graphs,
    check_stage_chain,
    split_joint_graph,
    trace_stage,
)
from tests.harness.parity import assert_parity

ATOL = 1e-6


@pytest.fixture(scope="module")
def llama():
    return build_llama(n_layers=2)


def _flat_state(m):
    return ([p.detach() for _, p in m.named_parameters(remove_duplicate=False)],
            [b for _, b in m.named_buffers(remove_duplicate=False)])


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def _check_against_joint(stage, traced, graphs: StageGraphs, user_inputs, output_grads):
    params, buffers = _flat_state(stage)
    sig = traced.signature
    joint = traced.graph(*params, *buffers, *user_inputs, *output_grads)
    j_out = joint[: sig.num_outputs]
    j_pg = joint[sig.num_outputs : sig.num_outputs + sig.num_param_grads]
    j_ig = joint[sig.num_outputs + sig.num_param_grads :]

    unsharded = graphs.unshard_params(params)
    outs, saved = graphs.forward_flat(unsharded, buffers, user_inputs)
    _close(outs, j_out)
    ig, pg = graphs.full_backward(outs, saved, tuple(output_grads))
    _close(pg, j_pg)
    _close(ig, j_ig)
    _close(graphs.reduce_grads(pg), j_pg)
    assert graphs.unshard_graph is None and graphs.reduce_grad_graph is None  # no FSDP here
    if sig.num_input_grads:
        assert graphs.supports_backward_input_weight_split
        ig2, live = graphs.backward_input(outs, saved, tuple(output_grads))
        _close(ig2, j_ig)
        _close(graphs.backward_weight(live), j_pg)
    return j_out, j_pg, j_ig


def test_middle_stage_splits_match_joint_and_eager(llama):
    stage = Blocks([llama.layers["0"], llama.layers["1"]])
    torch.manual_seed(1)
    x, g = torch.randn(2, 16, 256), torch.randn(2, 16, 256)
    traced = trace_stage(stage, (x,), output_grads=(g,))
    graphs = split_joint_graph(traced.graph, traced.signature, layouts=traced.layouts)
    assert traced.signature.num_input_grads == 1 and not traced.signature.is_last
    j_out, j_pg, j_ig = _check_against_joint(stage, traced, graphs, [x], [g])

    xe = x.clone().requires_grad_(True)
    ps = [p for p in stage.parameters()]
    out = stage(xe)
    grads = torch.autograd.grad(out, [*ps, xe], g)
    torch.testing.assert_close(j_out[0], out, atol=1e-5, rtol=0)
    assert len(grads) == len(j_pg) + len(j_ig)
    for i, (a, b) in enumerate(zip([*j_pg, *j_ig], grads)):
        assert_parity(a, b, what=f"joint graph gradient {i}")


def test_last_stage_splits_match_joint(llama):
    stage = Blocks([llama.layers["1"]])
    torch.manual_seed(2)
    x, tgt = torch.randn(2, 16, 256), torch.randn(2, 16, 256)
    traced = trace_stage(stage, (x,), loss_fn=mse_loss, target=tgt)
    assert traced.signature.is_last and traced.signature.num_output_grads == 0
    graphs = split_joint_graph(traced.graph, traced.signature, layouts=traced.layouts)
    _check_against_joint(stage, traced, graphs, [x, tgt], [])
    # forward through the runtime protocol returns the scalar loss
    params, buffers = _flat_state(stage)
    loss, _ = graphs.forward((x,), {}, tgt, {}, unsharded_param_values=params,
                             flat_buffer_values=buffers)
    torch.testing.assert_close(loss, mse_loss(stage(x), tgt), atol=1e-6, rtol=0)


def _weight_grad_mms(gm: fx.GraphModule, num_param_grads: int) -> set[str]:
    """Names of the mm nodes that produce parameter-gradient outputs (through views)."""
    (out,) = gm.graph.find_nodes(op="output")
    found: set[str] = set()
    for node in out.args[0][:num_param_grads]:
        while isinstance(node, fx.Node) and node.target is not torch.ops.aten.mm.default:
            ins = [a for a in node.all_input_nodes]
            if len(ins) != 1:
                break
            node = ins[0]
        if isinstance(node, fx.Node) and node.target is torch.ops.aten.mm.default:
            found.add(node.name)
    return found


def test_weight_piece_really_defers_weight_matmuls(llama):
    stage = Blocks([llama.layers["0"]])
    x = torch.randn(2, 16, 256)
    graphs = build_stage_graphs(stage, (x,))
    n_pg = graphs.convention.signature.num_param_grads
    wgrad_mms = _weight_grad_mms(graphs.full_backward_graph, n_pg)
    assert len(wgrad_mms) >= 5  # fused-or-not qkv, wo, w1, w2, w3
    names = lambda gm: {n.name for n in gm.graph.nodes}  # noqa: E731
    mm = lambda gm: {n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default}  # noqa: E731
    assert wgrad_mms <= mm(graphs.backward_weight_graph)
    assert not (wgrad_mms & names(graphs.backward_input_graph))
    # I computes only input-gradient matmuls, W only weight-gradient ones
    assert mm(graphs.backward_weight_graph) == wgrad_mms
    assert len(mm(graphs.backward_input_graph)) + len(wgrad_mms) == len(mm(graphs.full_backward_graph))


def test_graph_without_backward_is_rejected(llama):
    stage = Blocks([llama.layers["0"]])
    x = torch.randn(2, 16, 256)
    params, buffers = _flat_state(stage)
    fwd_only = torch.fx.experimental.proxy_tensor.make_fx(
        lambda *a: (torch.func.functional_call(stage, {
            **dict(zip([n for n, _ in stage.named_parameters()], a[:len(params)])),
            **dict(zip([n for n, _ in stage.named_buffers()], a[len(params):-1]))}, (a[-1],)),)
    )(*params, *buffers, x)
    sig = JointSignature(num_params=len(params), num_buffers=len(buffers), num_user_inputs=1,
                         num_output_grads=0, num_outputs=1, num_param_grads=len(params),
                         is_last=True)
    with pytest.raises(ValueError, match="no backward"):
        split_joint_graph(fwd_only, sig)
    with pytest.raises(ValueError, match="no backward"):
        JointSignature(num_params=1, num_buffers=0, num_user_inputs=1, num_output_grads=0,
                       num_outputs=1, num_param_grads=0, is_last=True)
    frozen = Blocks([llama.layers["0"]])
    try:
        frozen.requires_grad_(False)
        with pytest.raises(ValueError, match="no backward"):
            trace_stage(frozen, (x.int(),), output_grads=(x,))
    finally:
        frozen.requires_grad_(True)


def test_stage_outputs_must_fit_next_inputs(llama):
    x = torch.randn(2, 16, 256)
    a = build_stage_graphs(Blocks([llama.layers["0"]]), (x,))
    b = build_stage_graphs(Blocks([llama.layers["1"]]), (torch.randn(2, 8, 256),),
                           loss_fn=mse_loss, target=torch.randn(2, 8, 256))
    with pytest.raises(ValueError, match=r"stage 0 outputs .* do not fit stage 1 inputs"):
        check_stage_chain([a, b])
    with pytest.raises(ValueError, match="must be traced with loss_fn"):
        check_stage_chain([a])
    with pytest.raises(ValueError, match="user inputs"):
        a.forward_flat(a.unshard_params(_flat_state(Blocks([llama.layers["0"]]))[0]),
                       [], [x, x])


def test_aot_export_joint_graph_splits_match(llama):
    import contextlib

    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    from autopp.graph import from_aot_joint

    stage = Blocks([llama.layers["0"]])
    torch.manual_seed(3)
    x, g = torch.randn(2, 16, 256, requires_grad=True), torch.randn(2, 16, 256)
    with contextlib.ExitStack() as st:
        jd = aot_export_joint_with_descriptors(st, stage, (x,))
        joint, sig = from_aot_joint(jd.graph_module)
        assert sig.num_input_grads == 1 and sig.num_output_grads == 1
        graphs = split_joint_graph(joint, sig)
    params = [p.detach() for p in stage.parameters()]
    buffers = list(stage.buffers())
    assert sig.num_params == len(params) and sig.num_buffers == len(buffers)
    ref = joint(*params, *buffers, x.detach(), g)
    outs, saved = graphs.forward_flat(params, buffers, [x.detach()])
    _close(outs, ref[:1])
    ig, pg = graphs.full_backward(outs, saved, (g,))
    _close([*pg, *ig], ref[1:])
    ig2, live = graphs.backward_input(outs, saved, (g,))
    _close([*graphs.backward_weight(live), *ig2], ref[1:])


def _backward_with_a_weight_only_gather():
    """A backward graph (param grad, then input grad) whose weight gradient gathers a saved
    activation over 2 ranks and whose input gradient needs no collective."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD.group_name

    def backward(x, grad):
        gathered = torch.ops._c10d_functional.wait_tensor.default(
            torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, group))
        return (gathered * grad.sum()).sum(0, keepdim=True), grad * 3

    return make_fx(backward, tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 8))


def _collectives(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target)]


def test_a_collective_only_the_weight_gradient_needs_runs_in_w(fake_world2):
    """torchtitan's I/W split keeps every collective in I (dead-code elimination keeps
    ``wait_tensor``, a side effect to torch), so W held the gathered activation (8 x 8)
    from I to W where the planner counts what W reads (4 x 8). autopp's split leaves the
    gather in W, hands W the activation as saved, and restores torch's side-effect list."""
    from torch.fx import node as fx_node

    from autopp._compat import graph as compat

    wait = torch.ops._c10d_functional.wait_tensor.default
    theirs = compat._tt_split_di_dw_graph(_backward_with_a_weight_only_gather(),
                                          num_param_grads=1)
    assert _collectives(theirs.bw_di_module) and not _collectives(theirs.bw_dw_module)
    ours = compat.split_di_dw_graph(_backward_with_a_weight_only_gather(), num_param_grads=1)
    assert not _collectives(ours.bw_di_module)
    assert len(_collectives(ours.bw_dw_module)) == 2  # the gather and its wait
    live_ins = [n.meta["val"].shape for n in ours.bw_dw_module.graph.find_nodes(
        op="placeholder")]
    assert torch.Size([8, 8]) not in live_ins and torch.Size([4, 8]) in live_ins
    assert wait in fx_node._side_effectful_functions
