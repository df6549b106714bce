import torch
from torch import nn

from autopp._compat import sharding as compat
from autopp.sharding.options.strategies import all_placements, enumerate_strategies
from autopp.tracing.joint import trace_joint


def test_llama_block_has_no_fallbacks(llama_debug, make_mesh):
    mesh = make_mesh(2, 4)
    x = torch.empty(8, 16, 256, device="meta")
    j = trace_joint(llama_debug.layers["0"], (x, None, None))
    st = enumerate_strategies(j, mesh)
    assert st.fallbacks == []
    # a 2-D weight on a 2x4 mesh: {R, S(0), S(1)} per mesh dim, all even
    wo = j.params["attention.wo.weight"]
    assert len(st.nodes[wo].options) == 9
    mms = [ns for n, ns in st.nodes.items() if n.target == torch.ops.aten.mm.default]
    assert mms and all(len(ns.options) > 1 for ns in mms)
    # colwise-then-rowwise is reachable: some mm option wants the weight sharded on tp
    assert all(
        compat.StridedShard not in {type(p) for o in ns.options for pl in o.out for p in pl}
        for ns in st.nodes.values()
    )


def test_uneven_placements_are_pruned():
    assert (compat.Shard(0), compat.Replicate()) not in all_placements((3, 4), (2, 2))
    assert (compat.Replicate(), compat.Shard(1)) in all_placements((3, 4), (2, 2))


@torch.library.custom_op("autopp_test::double_it", mutates_args=())
def double_it(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double_it.register_fake
def _(x):
    return torch.empty_like(x)


double_it.register_autograd(lambda ctx, g: double_it(g))


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def forward(self, x):
        return double_it(x @ self.w)  # a custom op: no DTensor rule, no decomposition


def test_op_without_rule_falls_back_and_is_listed(make_mesh):
    with torch.device("meta"):
        m = Custom()
    j = trace_joint(m, (torch.empty(4, 8, device="meta"),))
    st = enumerate_strategies(j, make_mesh(2, 2))
    assert any("double_it" in f for f in st.fallbacks)
    node = next(n for n in st.nodes if "double_it" in str(n.target))
    (opt,) = st.nodes[node].options
    assert all(p == compat.Replicate() for p in opt.out[0])


class Huber(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def forward(self, x):  # aten.huber_loss has no DTensor rule but a decomposition
        return nn.functional.huber_loss(x @ self.w, x, reduction="none")


def test_op_without_rule_uses_decomposition_next(make_mesh):
    with torch.device("meta"):
        m = Huber()
    j = trace_joint(m, (torch.empty(4, 8, device="meta"),))
    st = enumerate_strategies(j, make_mesh(2, 2))
    assert st.fallbacks == []
    node = next(n for n in st.nodes if n.target == torch.ops.aten.huber_loss.default)
    outs = {o.out[0] for o in st.nodes[node].options}
    assert (compat.Shard(0), compat.Shard(1)) in outs  # sharded options, not just replication
