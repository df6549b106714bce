"""Activation recomputation in split graphs (``split_joint_graph(..., recompute=)``): the
graphs equal eager torch, save less (none > selective > full == the stage inputs), recompute
no collective and no random op, and run under ZBVZeroBubble at pp=2 (multi-process)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from graph_models import mse_loss  # noqa: E402

from autopp.graph import split_joint_graph, trace_stage  # noqa: E402
from autopp.lower.memory import saved_bytes  # noqa: E402
from tests.harness.launch import run_on_ranks
from tests.graph.graph_workers import recomputed as _recomputed
from tests.harness.parity import assert_parity

RECOMPUTE = ("none", "selective", "full")
D, HEADS, S, B = 32, 4, 8, 2


class _Block(nn.Module):
    """Pre-norm transformer block: attention (SDPA or matmul + softmax), then an MLP."""

    def __init__(self, sdpa: bool, act) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D, bias=False)
        self.sdpa, self.act = sdpa, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.n1(x)).view(*x.shape[:2], 3, HEADS, D // HEADS).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = torch.softmax(q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5, dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(x.shape))
        return x + self.down(self.act(self.up(self.n2(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(True, F.silu), _Block(False, F.gelu)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def case():
    """The net, one microbatch (input, output grad, target) and its two traces: a middle
    stage (output grads in) and a last stage (mse loss)."""
    torch.manual_seed(0)
    net = _Net()
    x, g, tgt = torch.randn(B, S, D), torch.randn(B, S, D), torch.randn(B, S, D)
    mid = trace_stage(net, (x,), output_grads=(g,))
    last = trace_stage(net, (x,), loss_fn=mse_loss, target=tgt)
    return net, x, g, tgt, mid, last


def _eager(net: nn.Module, x, g, tgt, last: bool):
    """Output (or loss), param grads and input grad by plain ``backward()``."""
    net.zero_grad(set_to_none=True)
    xe = x.clone().requires_grad_(True)
    out = net(xe)
    if last:
        out = mse_loss(out, tgt)
        out.backward()
    else:
        out.backward(g)
    return out.detach(), [p.grad.clone() for p in net.parameters()], xe.grad.clone()


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("split_weight_grad", [False, True], ids=["FB", "FIW"])
@pytest.mark.parametrize("peel_params", [False, True], ids=["", "peeled"])
@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_recompute_matches_eager(case, recompute, split_weight_grad, peel_params, last):
    net, x, g, tgt, mid, lst = case
    traced = lst if last else mid
    graphs = split_joint_graph(traced.graph, traced.signature, layouts=traced.layouts,
                               split_weight_grad=split_weight_grad, peel_params=peel_params,
                               recompute=recompute)
    assert graphs.convention.recompute == recompute
    params = [p.detach() for p in net.parameters()]
    user_inputs, grads = ([x, tgt], ()) if last else ([x], (g,))
    outs, saved = graphs.forward_flat(graphs.unshard_params(params), [], user_inputs)
    if split_weight_grad:
        ig, live = graphs.backward_input(outs, saved, grads)
        pg = graphs.backward_weight(live)
    else:
        assert graphs.backward_input_graph is None
        ig, pg = graphs.full_backward(outs, saved, grads)

    ref_out, ref_pg, ref_ig = _eager(net, x, g, tgt, last)
    assert_parity(outs[0], ref_out, what="output")
    assert len(pg) == len(ref_pg) and len(ig) == 1
    for i, (a, b) in enumerate(zip([*pg, *ig], [*ref_pg, ref_ig])):
        assert_parity(a, b, what=f"gradient {i}")

    bw_pieces = [graphs.full_backward_graph, graphs.backward_input_graph,
                 graphs.backward_weight_graph]
    if recompute == "none":
        assert not any(_recomputed(gm) for gm in bw_pieces)
        return
    assert _recomputed(graphs.full_backward_graph)
    if split_weight_grad:  # I recomputes what I needs; what only W needs, W recomputes
        i, w = _recomputed(graphs.backward_input_graph), _recomputed(graphs.backward_weight_graph)
        assert i and not (i & w)  # nothing recomputed twice
        handed_on = [ph for ph in graphs.backward_weight_graph.graph.find_nodes(op="placeholder")
                     if "recomputed_from" in ph.meta]
        assert handed_on  # W reads values I recomputed, as W's live-ins


@pytest.mark.parametrize("peel_params", [False, True], ids=["", "peeled"])
def test_saved_bytes_decrease_down_to_the_stage_inputs(case, peel_params):
    _net, _x, _g, _tgt, mid, last = case
    activation = B * S * D * 4  # one fp32 (B, S, D) tensor
    # the middle stage's backward reads its input; the mse backward also reads the target
    for traced, input_bytes in ((mid, activation), (last, 2 * activation)):
        sizes = {rc: saved_bytes(split_joint_graph(traced.graph, traced.signature,
                                                   peel_params=peel_params, recompute=rc))
                 for rc in RECOMPUTE}
        assert sizes["none"] > sizes["selective"] > sizes["full"] == input_bytes, sizes


def test_unknown_policy_is_rejected(case):
    *_, mid, _last = case
    with pytest.raises(ValueError, match="recompute must be one of"):
        split_joint_graph(mid.graph, mid.signature, recompute="some")


# -- collectives and random ops are saved, never recomputed ------------------------------

@pytest.fixture(scope="module")
def world_of_one():
    """A default process group (gloo, 1 rank) for a functional all-reduce, if none is up."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


class _AllReduce(torch.autograd.Function):
    """Megatron's "reduce from the tensor-parallel region": all-reduce, identity backward."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, g):
        return g


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D)

    def forward(self, x):
        h = _AllReduce.apply(self.a(x))
        h = F.gelu(h + 0.1 * torch.randn_like(h))
        return self.b(F.dropout(h, p=0.25, training=True))


def _is_collective_or_random(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and (
        "c10d" in getattr(t, "namespace", "")
        or torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_collectives_and_random_ops_are_saved_not_recomputed(world_of_one, recompute):
    torch.manual_seed(0)
    net = _Noisy()
    x, g = torch.randn(B, S, D), torch.randn(B, S, D)
    traced = trace_stage(net, (x,), output_grads=(g,))
    params = [p.detach() for p in net.parameters()]
    results = {}
    for rc in ("none", recompute):
        graphs = split_joint_graph(traced.graph, traced.signature, recompute=rc)
        torch.manual_seed(1)
        outs, saved = graphs.forward_flat(params, [], [x])
        rng = torch.get_rng_state()
        ig, live = graphs.backward_input(outs, saved, (g,))
        results[rc] = (outs, ig, graphs.backward_weight(live), graphs, rng)
    outs, ig, pg, graphs, rng = results[recompute]
    for a, b in zip([*outs, *ig, *pg], [*results["none"][0], *results["none"][1],
                                        *results["none"][2]]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # the forward's all-reduce, noise and dropout mask are saved; the backward draws nothing
    fwd = graphs.forward_graph
    special = {n.name for n in fwd.graph.nodes if _is_collective_or_random(n)}
    assert {"all_reduce", "wait_tensor", "randn_like"} <= special
    assert {"wait_tensor", "randn_like"} <= set(graphs.convention.saved_for_backward)
    assert any(n.startswith("bernoulli") for n in graphs.convention.saved_for_backward)
    for gm in (graphs.full_backward_graph, graphs.backward_input_graph,
               graphs.backward_weight_graph):
        assert not [n.name for n in gm.graph.nodes if _is_collective_or_random(n)], gm.graph
    assert _recomputed(graphs.full_backward_graph)  # e.g. gelu's input, the dropout product
    assert torch.equal(torch.get_rng_state(), rng)  # no random number drawn by I or W


# -- under a real zero-bubble schedule ----------------------------------------------------



@pytest.mark.multiprocess
def test_recompute_under_zbv_matches_single_process():
    from tests.graph.graph_workers import zbv_recompute

    for lines in run_on_ranks(zbv_recompute, 2, timeout=600):
        assert len(lines) == 2 and all("grads ok" in line for line in lines), lines
