"""Routed experts dispatching tokens by all-to-all (``autopp.sharding.options.expert_dispatch``).

On 4 gloo ranks the op, given its devices' token rows and expert shards and a process group,
equals a dense hand-written MoE (every expert on every token, weighted by the routing):
output, input and score gradients for the rank's rows, weight gradients for its experts.
Cases: one flat group of 4; a 2 x 2 mesh dispatching over the outer dim with experts split
further over the inner one; and over the inner dim inside each outer block. Single-process
checks: the options the planner gets, and their all-to-all price.
"""

from __future__ import annotations

import pytest
import torch

from autopp.ops import experts  # noqa: F401  (registers the op and its hooks)
from tests.harness.launch import run_on_ranks
from tests.harness.workers.dispatch import run
from tests.harness.parity import assert_parity


@pytest.mark.multiprocess
def test_all_to_all_dispatch_matches_a_dense_moe():
    results = run_on_ranks(run, 4, timeout=300)
    names = ["output", "x grad", "scores grad", "w1 grad", "w2 grad", "w3 grad"]
    for rank, (res, syncs) in enumerate(results):
        # one read of every size the exchange needs per direction (no boolean mask,
        # bincount or per-size read); the forward exchanges counts, tokens and outputs, the
        # backward reuses its routing: no sort, no count exchange, tokens with their
        # gradients out and gradients back
        assert syncs == {"forward": (["tolist"], 3, True),
                         "backward": (["tolist"], 2, False)}, (rank, syncs)
        for case, (got, want) in res.items():
            for name, a, b in zip(names, got, want):
                assert_parity(a, b, what=f"rank {rank} {case} {name}")


def _routed_node(mode: str, batch: int = 4):
    """A qwen3 MoE block (64 experts, top 8) traced with token dispatch ``mode``: the joint
    graph and its forward routed-experts node."""
    pytest.importorskip("torchtitan")
    import copy

    from autopp.adapters.torchtitan_moe import set_token_dispatch, token_dispatch
    from autopp.tracing.joint import trace_joint
    from tests.harness.models import qwen3_moe_meta

    block = qwen3_moe_meta(1).layers["0"]
    with torch.device("meta"):
        x = torch.empty(batch, 16, block.moe.router.gate.weight.shape[1])
    before = token_dispatch()
    set_token_dispatch(mode)
    try:
        joint = trace_joint(copy.deepcopy(block), (x, None, None))
    finally:
        set_token_dispatch(before)
    node = next(n for n in joint.gm.graph.nodes
                if n.target == torch.ops.autopp.routed_experts.default)
    return joint, node


def _kinds(node, options) -> set[str]:
    from autopp.sharding.options.expert_dispatch import dispatch_dims

    out = set()
    for o in options:
        if dispatch_dims(node, o):
            out.add("all_to_all")
        elif any(p.is_shard() for p in o.ins[3]):
            out.add("all_gather")
        else:
            out.add("local")
    return out


@pytest.mark.parametrize("mode,kinds", [
    ("auto", {"all_to_all", "all_gather", "local"}),
    ("all_to_all", {"all_to_all"}),
    ("all_gather", {"all_gather", "local"}),
])
def test_planner_gets_the_dispatch_options_the_setting_allows(make_mesh, mode, kinds):
    from autopp.sharding.options.expert_dispatch import dispatch_dims
    from autopp.sharding.options.strategies import enumerate_strategies

    joint, node = _routed_node(mode)
    st = enumerate_strategies(joint, make_mesh(2, 2))
    options = st.nodes[node].options
    assert _kinds(node, options) == kinds
    groups = set()
    for o in options:
        dims = dispatch_dims(node, o)
        groups.add(dims)
        for d in dims:  # tokens keep their split; the output is split like them
            assert o.out[0][d] == o.ins[0][d] and o.ins[0][d].is_shard()
    if "all_to_all" in kinds:  # over dp, over tp, and over dp x tp as one group
        assert {(0,), (1,), (0, 1)} <= groups
    bwd = next(n for n in joint.gm.graph.nodes
               if n.target == torch.ops.autopp.routed_experts_backward.default)
    assert _kinds_bwd(bwd, st.nodes[bwd].options) == kinds


def test_backward_takes_the_forwards_routing_as_it_was_made(make_mesh):
    """The forward's routing (order, counts) is per-device state: the solver links the
    backward's routing inputs (pinned, positions 8 and 9) to the forward's outputs only in
    equal placements, never through a redistribution, and every placement the forward can
    give them has such a link."""
    from autopp.profiles import get_profile
    from autopp.sharding.cost.model import CostModel
    from autopp.sharding.ilp.solver import Model
    from autopp.sharding.options.strategies import enumerate_strategies

    joint, fwd = _routed_node("auto")
    bwd = next(n for n in joint.gm.graph.nodes
               if n.target == torch.ops.autopp.routed_experts_backward.default)
    st = enumerate_strategies(joint, make_mesh(2, 2))
    model = Model(st, CostModel(get_profile("H100"), (2, 2)))
    for i, k in ((8, 1), (9, 2)):
        src, idx = st.nodes[bwd].edges[i]
        assert src.args[0] is fwd and src.args[1] == k  # getitem of the forward's output k
        pairs = {(a, g) for _, a, g in model.edge_cols[bwd, i]}
        assert pairs and all(a == g for a, g in pairs), (i, pairs)
        made = {o.out[0] for o in st.nodes[src].options}
        assert made <= {a for a, _ in pairs}, (i, made)


def _kinds_bwd(node, options) -> set[str]:
    from autopp.sharding.options.expert_dispatch import dispatch_dims

    return {"all_to_all" if dispatch_dims(node, o)
            else "all_gather" if any(p.is_shard() for p in o.ins[4]) else "local"
            for o in options}


def test_all_to_all_moves_k_rows_per_token_and_wins_only_when_ep_exceeds_top_k(make_mesh):
    """Hand-computed volume: with the batch split over n devices each sends its T/n tokens'
    K = 8 routed rows of D floats, twice (tokens out, outputs back). Gathering instead moves
    (n-1)·T/n tokens in and reduce-scatters the output: all-to-all is the cheaper only when
    n > K (here n = 16 against n = 4)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autopp.profiles import get_profile
    from autopp.sharding.cost.model import CostModel
    from autopp.sharding.options.op_hooks import hooks_of
    from autopp.sharding.options.strategies import NodeStrategy, Option, tensor_vals

    for n, a2a_cheaper in ((4, False), (16, True)):
        # bandwidth-bound sizes: 512 batch rows a device (at 64 the 9 or 12 ring steps of
        # 5 us the collectives pay made up most of the time)
        joint, node = _routed_node("auto", batch=512 * n)
        x, ids = tensor_vals(node.args[0])[0], tensor_vals(node.args[2])[0]
        d, k = x.shape[-1], ids.shape[-1]
        s0, r = (Shard(0),), (Replicate(),)
        a2a = Option((s0,), (s0, s0, s0, s0, s0, s0, s0))
        colls = hooks_of(node.target).collectives(node, a2a, (n,))
        rows = 512 * 16 * k  # 512 batch rows of 16 tokens per device, K rows each
        assert colls[1:] == [("all_to_all", (0,), rows * d * 4)] * 2
        # its backward exchanges no counts: tokens, output gradients and fp32 scores out,
        # token and score gradients back
        bwd = next(m for m in joint.gm.graph.nodes
                   if m.target == torch.ops.autopp.routed_experts_backward.default)
        colls = hooks_of(bwd.target).collectives(bwd, Option((s0,) * 5, (s0,) * 10), (n,))
        assert colls == [("all_to_all", (0,), rows * (2 * d + 1) * 4),
                         ("all_to_all", (0,), rows * (d + 1) * 4)]
        costs = CostModel(get_profile("H100"), (n,))
        ns = NodeStrategy(node, "op", [(a, 0) for a in node.args[:7]])
        t_a2a = costs.kernel_comm_time(ns, a2a)
        t_gather = sum(costs.redistribute(s0, r, tuple(v.shape), v.dtype)[0]
                       for v in (tensor_vals(a)[0] for a in node.args[:3]))
        t_gather += costs.redistribute((Partial(),), s0, tuple(x.shape), x.dtype)[0]
        assert (t_a2a < t_gather) == a2a_cheaper, (n, t_a2a, t_gather)


def test_expert_imbalance_prices_the_busiest_expert_parallel_device(make_mesh):
    """Routing is priced uniform by default; ``PlannerOptions.expert_imbalance`` x prices the
    busiest device's routed rows at x times the mean where the experts are split (its
    compute and its all-to-all rows), and leaves replicated experts as they were."""
    from torch.distributed.tensor import Replicate, Shard

    from autopp import tracing
    from autopp.backends import PlannerOptions
    from autopp.profiles import get_profile
    from autopp.sharding.cost.model import CostModel
    from autopp.sharding.options.op_hooks import hooks_of
    from autopp.sharding.options.strategies import NodeStrategy, Option

    with pytest.raises(ValueError, match="expert_imbalance '1.33'"):
        PlannerOptions(expert_imbalance=1.33)
    assert PlannerOptions().trace_settings()["expert_imbalance"] == "1"
    _, node = _routed_node("auto", batch=64)
    s0, r = (Shard(0),), (Replicate(),)
    split = Option((s0,), (s0, s0, s0, s0, s0, s0, s0))  # experts and tokens over the dim
    whole = Option((s0,), (s0, s0, s0, r, r, r, r))  # every device holds every expert
    costs = CostModel(get_profile("H100"), (4,))
    ns = NodeStrategy(node, "op", [(a, 0) for a in node.args[:7]])

    def priced(x: str) -> tuple[float, float, list]:
        with tracing.settings(PlannerOptions(expert_imbalance=float(x)).trace_settings()):
            return (costs.compute_time(ns, split) - costs.kernel_comm_time(ns, split),
                    costs.compute_time(ns, whole),
                    hooks_of(node.target).collectives(node, split, (4,)))

    (c1, w1, a1), (c2, w2, a2) = priced("1"), priced("1.5")
    assert c2 == pytest.approx(1.5 * c1) and w2 == w1
    assert a2[0] == a1[0] and [b for *_, b in a2[1:]] == [1.5 * b for *_, b in a1[1:]]


@pytest.mark.parametrize("dims,split", [("tp", (1,)), ("dp", (0,)), ("dp*tp", (0, 1))])
def test_expert_dims_pin_the_devices_the_experts_are_split_over(make_mesh, dims, split):
    """``PlannerOptions.expert_dims`` (torchtitan's ``ep`` group): every option the planner
    gets for the routed experts, forward and backward, splits them over exactly those dims,
    and with all-to-all dispatch exchanges tokens over exactly them; the planned block
    does so. A dim of one device is refused by name."""
    import copy

    from autopp import tracing
    from autopp.backends import PlannerOptions
    from autopp.sharding import plan_stage
    from autopp.sharding.options.expert_dispatch import dispatch_dims
    from autopp.sharding.options.strategies import enumerate_strategies
    from tests.harness.models import qwen3_moe_meta
    from tests.harness.stage_request import stage_request

    joint, node = _routed_node("all_to_all")
    bwd = next(n for n in joint.gm.graph.nodes
               if n.target == torch.ops.autopp.routed_experts_backward.default)
    options = PlannerOptions(token_dispatch="all_to_all", expert_dims=dims)
    with tracing.settings(options.trace_settings()):
        st = enumerate_strategies(joint, make_mesh(2, 2))
    for n, eid in ((node, 3), (bwd, 4)):
        opts = st.nodes[n].options
        assert opts
        for o in opts:
            assert tuple(d for d, p in enumerate(o.ins[eid]) if p.is_shard()) == split
            assert dispatch_dims(n, o) == split
    block = qwen3_moe_meta(1).layers["0"]
    with torch.device("meta"):
        x = torch.empty(4, 16, block.moe.router.gate.weight.shape[1])
    with tracing.settings(options.trace_settings()):
        plan = plan_stage(stage_request(copy.deepcopy(block), (x, None, None),
                                        make_mesh(2, 2), profile="H100"))
    assert dict(plan.trace_settings)["expert_dims"] == dims
    chosen = [(name, ins) for bp in plan.blocks for name, _, ins in bp.nodes
              if name.startswith("routed_experts")]
    assert len(chosen) == 2  # forward and backward
    for name, ins in chosen:
        held = ins[4 if "backward" in name else 3]
        assert tuple(d for d, p in enumerate(held) if p.startswith("S")) == split, name
    with tracing.settings(PlannerOptions(expert_dims="tp").trace_settings()):
        with pytest.raises(ValueError, match="expert_dims='tp'.*tp, which has 1 device"):
            enumerate_strategies(joint, make_mesh(4, 1))


def test_token_dispatch_is_a_planner_option_the_plan_carries(make_mesh):
    """``PlannerOptions.token_dispatch`` / ``expert_compute_dtype`` are checked, default to
    the process default (``set_token_dispatch`` is an alias that changes it), and a stage
    planned under them records them: applying the plan re-traces with the plan's values,
    not with the process default of the applying process."""
    pytest.importorskip("torchtitan")
    import copy

    from autopp import tracing
    from autopp.adapters.torchtitan_moe import set_token_dispatch, token_dispatch
    from autopp.backends import PlannerOptions
    from autopp.lower.apply import planned_units
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request
    from tests.harness.models import qwen3_moe_meta

    with pytest.raises(ValueError, match="token_dispatch 'everywhere'.*'all_to_all'"):
        PlannerOptions(token_dispatch="everywhere")
    with pytest.raises(ValueError, match="expert_compute_dtype 'int8'"):
        PlannerOptions(expert_compute_dtype="int8")
    block = qwen3_moe_meta(1).layers["0"]
    with torch.device("meta"):
        x = torch.empty(4, 16, block.moe.router.gate.weight.shape[1])
    mesh = make_mesh(2, 2)
    before = token_dispatch()
    try:
        set_token_dispatch("all_to_all")
        options = PlannerOptions()
        assert options.token_dispatch == "all_to_all"  # the alias sets the default
        options = PlannerOptions(token_dispatch="all_gather", expert_compute_dtype="param")
        with tracing.settings(options.trace_settings()):
            plan = plan_stage(stage_request(copy.deepcopy(block), (x, None, None), mesh,
                                            profile="H100"))
        assert dict(plan.trace_settings) == {"token_dispatch": "all_gather",
                                             "expert_dims": "auto",
                                             "expert_compute_dtype": "param",
                                             "expert_imbalance": "1"}
        from autopp.sharding.plan import StagePlan

        plan = StagePlan.from_json(plan.to_json())  # as saved and loaded
        assert dict(plan.trace_settings)["token_dispatch"] == "all_gather"
        # the process default now differs from the plan's: the re-trace follows the plan
        _, _, joint, _ = next(planned_units(copy.deepcopy(block), plan, mesh, (x, None, None),
                                            lower=False))
        node = next(n for n in joint.gm.graph.nodes
                    if n.target == torch.ops.autopp.routed_experts.default)
        assert node.args[-1] == "all_gather" and node.args[-2] == ""
    finally:
        set_token_dispatch(before)


def test_tracing_settings_nest_and_refuse_unknown_values():
    from autopp import tracing

    default = tracing.setting("token_dispatch")
    with tracing.settings({"token_dispatch": "all_gather"}):
        with tracing.settings({"token_dispatch": "all_to_all"}):
            assert tracing.setting("token_dispatch") == "all_to_all"
        assert tracing.setting("token_dispatch") == "all_gather"
        assert tracing.current_settings()["token_dispatch"] == "all_gather"
    assert tracing.setting("token_dispatch") == default
    with pytest.raises(ValueError, match="expected one of 'auto', 'all_to_all', 'all_gather'"):
        with tracing.settings({"token_dispatch": "broadcast"}):
            pass
    with pytest.raises(KeyError, match="unknown tracing setting 'no_such'"):
        tracing.setting("no_such")
