"""``autopp.graph.walk.is_view``, the one view rule of the planner's costs and memory row, the
lowered graphs' memory count and the reduce-grad walk, checked against what torch does: a
node is a view exactly when running it eagerly returns a tensor in its input's storage."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopp.graph.walk import is_view

pytestmark = pytest.mark.compat  # torch's tracing of .detach() differs between versions


def _ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x.view(4, 6).t()  # view, t
    b = x.reshape(24)[3:9]  # reshape of a contiguous tensor: a view; slice
    c = x[1].unsqueeze(0).expand(3, 4, 3)  # select, unsqueeze, expand
    d, e = torch.split(x.flatten(), [10, 14])  # split: getitem of views
    f = x.permute(2, 0, 1).reshape(3, 8)  # permute, reshape
    g = torch.cat([d, e]) + b.sum() + a.sum() + c.sum()  # cat, add: new memory
    h = (x.clone() @ w).transpose(0, 1).detach()  # clone, mm with _unsafe_view, transpose
    return g.sum() + f.sum() + h.sum()


def test_is_view_is_what_torch_returns_in_its_inputs_storage():
    x, w = torch.randn(2, 4, 3), torch.randn(3, 5)
    gm = make_fx(_ops)(x, w)
    env = _run(gm, (x, w))
    checked: dict[str, int] = {}
    for node in [n for n in gm.graph.nodes if n.op == "call_function"]:
        val = env[node]
        ins = [env[i] for i in node.all_input_nodes]
        outs = [v for v in (val if isinstance(val, (list, tuple)) else [val])
                if isinstance(v, torch.Tensor)]
        shares = bool(outs) and all(any(
            isinstance(i, torch.Tensor)
            and o.untyped_storage().data_ptr() == i.untyped_storage().data_ptr()
            for i in ins) for o in outs)
        if node.target is operator.getitem:  # a tuple's element: the tuple held it already
            shares = True
        assert is_view(node) == shares, (node.format_node(), shares)
        checked[str(node.target)] = checked.get(str(node.target), 0) + 1
    views = {t for t in checked if is_view(next(n for n in gm.graph.nodes
                                                 if str(n.target) == t))}
    # the graph has both kinds; _unsafe_view is a view its schema does not mark
    assert {"aten.view.default", "aten.t.default", "aten.select.int", "aten.expand.default",
            "aten.split_with_sizes.default", "aten.slice.Tensor", "aten._unsafe_view.default",
            } <= views, views
    # .detach() is traced as aten.detach (torch 2.13) or aten.alias (2.14): a view either way
    assert {"aten.detach.default", "aten.alias.default"} & views, views
    assert {"aten.cat.default", "aten.clone.default", "aten.mm.default"} & views == set()


def _run(gm: fx.GraphModule, args) -> dict[fx.Node, object]:
    """Each node's eager value."""
    env: dict[fx.Node, object] = {}
    it = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "call_function":
            a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            env[node] = node.target(*a, **k)
    return env
