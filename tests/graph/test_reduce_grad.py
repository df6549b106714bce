"""Where a gradient's reduction starts (autopp.graph.reduce_grad): the step accumulates the
gradient as the backward computed it, not after a redistribution has gathered it."""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopp._compat import graph as compat
from autopp.graph.reduce_grad import reduce_grad_split_point

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _node(g: fx.Graph, target, args, shape, dtype=torch.float32):
    n = g.call_function(target, args)
    n.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return n


def _nested_gradient_graph(gathered_read_elsewhere: bool) -> fx.GraphModule:
    """A weight gradient ``[32, 16]`` (bf16), cast to fp32, then redistributed as DTensor
    does for a weight sharded twice on dim 1: all-gather over one group (``[64, 16]``),
    regroup on dim 1 (``[32, 32]``), reduce-scatter over the other (``[16, 32]``)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(64, 32, dtype=torch.bfloat16, device="meta")
    dy = g.placeholder("dy")
    dy.meta["val"] = torch.empty(64, 16, dtype=torch.bfloat16, device="meta")
    xt = _node(g, aten.t.default, (x,), (32, 64), torch.bfloat16)
    grad = _node(g, aten.mm.default, (xt, dy), (32, 16), torch.bfloat16)
    cast = g.call_function(aten._to_copy.default, (grad,), {"dtype": torch.float32})
    cast.meta["val"] = torch.empty(32, 16, device="meta")
    ag = _node(g, c10d.all_gather_into_tensor.default, (cast, 2, "0"), (64, 16))
    agw = _node(g, c10d.wait_tensor.default, (ag,), (64, 16))
    parts = g.call_function(aten.split.Tensor, (agw, 32))
    parts.meta["val"] = (torch.empty(32, 16, device="meta"),) * 2
    p0 = _node(g, operator.getitem, (parts, 0), (32, 16))
    p1 = _node(g, operator.getitem, (parts, 1), (32, 16))
    cat = _node(g, aten.cat.default, ([p0, p1], 1), (32, 32))
    rs = _node(g, c10d.reduce_scatter_tensor.default, (cat, "sum", 2, "1"), (16, 32))
    rsw = _node(g, c10d.wait_tensor.default, (rs,), (16, 32))
    out = _node(g, aten.clone.default, (rsw,), (16, 32))
    outs = [out]
    if gathered_read_elsewhere:  # an input gradient computed from the gathered value
        outs.append(_node(g, aten.sum.default, (agw,), ()))
    else:
        outs.append(_node(g, aten.mm.default, (dy, grad), (64, 16), torch.bfloat16))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _cut(gm: fx.GraphModule, split_point=reduce_grad_split_point) -> list[tuple[int, ...]]:
    split = compat.split_backward_fsdp_collectives(gm, num_param_grads=1, split_point=split_point)
    rg = split.reduce_grad_module
    return [tuple(ph.meta["val"].shape) for ph in rg.graph.find_nodes(op="placeholder")]


def test_cut_moves_to_the_cast_gradient_and_reduce_grad_runs_the_gather():
    gm = _nested_gradient_graph(gathered_read_elsewhere=False)
    assert _cut(gm, split_point=None) == [(32, 32)]  # torchtitan's: the gathered gradient
    assert _cut(gm) == [(32, 16)]  # the cast gradient: half the bytes here, 1/tp in general
    split = compat.split_backward_fsdp_collectives(gm, num_param_grads=1,
                                                   split_point=reduce_grad_split_point)
    targets = {str(n.target) for n in split.reduce_grad_module.graph.nodes}
    assert {"_c10d_functional.all_gather_into_tensor.default",
            "_c10d_functional.reduce_scatter_tensor.default"} <= targets
    bw_targets = {str(n.target) for n in split.bw_no_fsdp_module.graph.nodes}
    assert not any("c10d" in t for t in bw_targets), bw_targets


def test_cut_stays_where_the_gathered_gradient_is_read_elsewhere():
    gm = _nested_gradient_graph(gathered_read_elsewhere=True)
    assert _cut(gm) == [(32, 32)]
