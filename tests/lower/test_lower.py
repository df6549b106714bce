"""Lowering a plan to a local joint graph with explicit collectives (autopp.lower.local_graphs)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from autopp.sharding.plan import from_strs


def _planned_block(mesh, stack_of):
    """One llama3 block planned on ``mesh`` under a quarter of its weights' bytes (so its
    weights are sharded): ``(block stack, meta input, plan)``."""
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request

    stack = stack_of(1)
    total = sum(p.numel() * p.element_size() for p in stack.parameters())
    x = torch.empty(4, 16, 256, device="meta")
    return stack, x, plan_stage(stage_request(stack, (x,), mesh, memory_budget_bytes=total / 4,
                                              output_placements=None))


def test_lowered_block_has_local_shapes_and_collectives(make_mesh, stack_of):
    from autopp.tracing.units import stage_units
    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.tracing.joint import trace_joint

    mesh = make_mesh(2, 2)
    stack, x, plan = _planned_block(mesh, stack_of)
    (bplan,) = plan.blocks
    (unit,) = stage_units(stack)
    joint = trace_joint(unit.module, (x,))
    lj = lower_joint(joint, bplan, mesh)

    sig = lj.signature
    assert (sig.num_params, sig.num_buffers) == (len(joint.params), len(joint.buffers))
    assert (sig.num_user_inputs, sig.num_output_grads, sig.input_grad_indices) == (1, 1, (0,))
    assert lj.param_fqns == tuple(joint.params)
    nodes = [*joint.params.values(), *joint.buffers.values(), joint.inputs[0], joint.tangents[0]]
    placeholders = lj.gm.graph.find_nodes(op="placeholder")
    assert len(placeholders) == len(nodes) == len(lj.input_shapes)
    sharded_some = False
    for ph, node, shape, pl in zip(placeholders, nodes, lj.input_shapes, lj.input_placements):
        local = list(node.meta["val"].shape)  # the global shape, divided by each sharded dim
        for p, n in zip(from_strs(pl), mesh.shape):
            if p.is_shard():
                local[p.dim] //= n
        assert tuple(ph.meta["val"].shape) == shape == tuple(local), (node.name, pl)
        sharded_some |= tuple(local) != tuple(node.meta["val"].shape)
    assert sharded_some
    counts = lj.collective_counts()
    assert sum(counts.values()) > 0 and "all_gather_into_tensor" in counts, counts
    for node in lj.gm.graph.nodes:
        assert not any(isinstance(v, DTensor)
                       for v in torch.utils._pytree.tree_leaves(node.meta.get("val")))
    graphs = split_local(lj)
    assert graphs.backward_input_graph is not None and graphs.backward_weight_graph is not None
    assert graphs.convention.signature == sig


@pytest.mark.multiprocess
@pytest.mark.wide  # the planned pipelines' parity tests run this path end to end
def test_lowered_llama_stack_matches_single_process_on_2x2_gloo():
    from tests.harness.launch import run_on_ranks
    from tests.lower._lower_worker import run_lower

    results = run_on_ranks(run_lower, 4, 2, 2, 3)
    for rank, r in enumerate(results):
        errs = r["errs"]
        assert len(errs) == 2 + r["num_params"], sorted(errs)  # output, input grad, params
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}
        assert not bad, (rank, bad, r["placements"])
        assert r["dtensor_nodes"] == 0
        for counts in r["counts"]:
            assert sum(counts.values()) > 0, counts
        bad = {k: v for k, v in r["split_errs"].items() if not v <= 1e-6}
        assert not bad, (rank, bad)
    # the plan really shards: no parameter is replicated on both mesh dims
    assert all(pl != ["R", "R"] for pl in results[0]["placements"].values())
    print("peeled unshard graphs:", results[0]["peeled"])
    print("block 0 fwd+bwd medians (s), rank 0:", results[0]["timings"])


def test_lowered_pieces_issue_collectives_early_and_wait_at_first_use(make_mesh, stack_of):
    """Every piece of a planned stage (forward, backward, I, W, unshard, reduce-grad): each
    collective right after its last input, each wait right before the first use of its
    value, the collectives in the order the plain split issues them."""
    from autopp.lower.local_graphs import lower_joint, split_local
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units
    from tests.graph.test_overlap import check_overlapped, collective_order

    mesh = make_mesh(2, 2)
    stack, x, plan = _planned_block(mesh, stack_of)
    (unit,) = stage_units(stack)
    lj = lower_joint(trace_joint(unit.module, (x,)), plan.blocks[0], mesh)
    plain = split_local(lj, overlap=False).graphs()
    overlapped = split_local(lj).graphs()
    assert set(plain) == set(overlapped) == {"forward", "full_backward", "backward_input",
                                            "backward_weight", "unshard", "reduce_grad"}
    deferred, late = {}, []
    for name, gm in overlapped.items():
        assert collective_order(gm) == collective_order(plain[name]), name
        n, deferred[name] = check_overlapped(gm)
        assert n == len(collective_order(plain[name]))
        try:
            check_overlapped(plain[name])
        except AssertionError:
            late.append(name)
    assert deferred["unshard"] > 0 and deferred["forward"] > 0, deferred  # all gathers, then all waits
    assert sum(deferred.values()) > 3, deferred
    assert late, "the plain split was already in overlap order: the test sees nothing"



@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_shard_to_shard_is_traced_as_the_target_device_runs_it(make_mesh, device_type):
    """S(0) -> S(1) over tp on a (fake) CPU mesh: gloo has no all-to-all, so DTensor gathers
    the whole tensor (tp x the shard) and keeps a chunk; for a CUDA target the dry run
    traces the all-to-all the devices run, no tensor larger than the shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopp._compat.sharding import shard_to_shard_as_on

    mesh = make_mesh(2, 2)

    def move(local):
        d = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
        return d.redistribute(mesh, [Replicate(), Shard(1)]).to_local()

    shard = torch.empty(8, 16, device="meta")
    with shard_to_shard_as_on(device_type):
        gm = make_fx(move)(shard)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    largest = max(n.meta["val"].numel() for n in gm.graph.nodes
                  if isinstance(n.meta.get("val"), torch.Tensor))
    if device_type == "cpu":
        assert "_c10d_functional.all_gather_into_tensor.default" in targets
        assert largest == 2 * shard.numel()
    else:
        assert "_c10d_functional.all_to_all_single.default" in targets
        assert not any("all_gather" in t for t in targets)
        assert largest == shard.numel()
    (out,) = gm.graph.find_nodes(op="output")
    result = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    assert tuple(result.meta["val"].shape) == (16, 8)


def _planned_units(stack, mesh):
    """(plan, LoweredUnit per block, the stage's (input, output) placements) of ``stack``
    planned on ``mesh`` under a quarter of its parameter bytes."""
    from autopp.lower.local_graphs import LoweredUnit
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    total = sum(p.numel() * p.element_size() for p in stack.parameters())
    x = torch.empty(4, 16, 256, device="meta")
    plan = plan_stage(stage_request(stack, (x,), mesh, memory_budget_bytes=total / 4,
                                    output_placements=None))
    units = []
    for bplan, unit in zip(plan.blocks, stage_units(stack)):
        joint = trace_joint(unit.module, (x,))
        units.append(LoweredUnit(joint, bplan, tuple(f"{unit.name}.{f}" for f in joint.params),
                                 tuple(joint.buffers)))
    return plan, units, (from_strs(plan.input_placements), from_strs(plan.output_placements))


def test_a_stage_lowered_again_is_reused_with_the_current_meshs_groups(make_mesh, stack_of,
                                                                     monkeypatch):
    """A stage lowered before in the process (same units, plans, ranks, boundaries) is
    served again; on a new mesh over the same ranks (new process groups) its collectives
    name the new mesh's groups, and the graph is the one a fresh lowering on that mesh gives
    (op for op, each collective over the same ranks: DTensor's own caches treat equal
    meshes as one, so a fresh lowering may name either mesh's groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    from autopp._compat import sharding as compat
    from autopp.lower import reuse
    from autopp.lower.local_graphs import lower_stage, split_local

    mesh = make_mesh(2, 2)
    plan, units, ends = _planned_units(stack_of(1), mesh)
    reuse.clear()
    first = reuse.lowered_stage(units, mesh, *ends)
    again = reuse.lowered_stage(units, mesh, *ends)
    assert reuse.reuse_stats() == {"hits": 1, "misses": 1}
    assert again.gm is first.gm and again.param_fqns == first.param_fqns

    other = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    old = {mesh.get_group(i).group_name for i in range(2)}
    new = {other.get_group(i).group_name for i in range(2)}
    assert not old & new  # a new mesh, new process groups over the same ranks
    moved = reuse.lowered_stage(units, other, *ends)
    assert reuse.reuse_stats() == {"hits": 2, "misses": 1}
    named = reuse._group_names(moved.gm)
    assert named and named <= new, (named, new)
    fresh = lower_stage(units, other, *ends)

    def by_ranks(gm):
        code = gm.code
        for name in reuse._group_names(gm):
            code = code.replace(f"'{name}'", str(compat.group_ranks(name)))
        return code

    assert by_ranks(moved.gm) == by_ranks(fresh.gm)
    # and so are its pieces, split once per recompute mode
    pieces = reuse.split_stage(moved, recompute="selective", overlap=True).graphs()
    fresh_pieces = split_local(fresh, recompute="selective", overlap=True).graphs()
    assert pieces.keys() == fresh_pieces.keys() and "unshard" in pieces
    for name, gm in pieces.items():
        assert reuse._group_names(gm) <= new, name
        assert by_ranks(gm) == by_ranks(fresh_pieces[name]), name
    splits = []
    monkeypatch.setattr(reuse, "split_local",
                        lambda *a, **k: splits.append(a) or split_local(*a, **k))
    again = reuse.split_stage(reuse.lowered_stage(units, other, *ends), recompute="selective",
                              overlap=True).graphs()
    assert not splits and all(by_ranks(again[n]) == by_ranks(gm) for n, gm in pieces.items())
    reuse.split_stage(moved, recompute="full", overlap=True)
    assert len(splits) == 1
    # a stage taking its input in another placement is lowered afresh
    replicated = tuple(from_strs(("R",) * 2))
    assert replicated != ends[0]
    reuse.lowered_stage(units, other, replicated, ends[1])
    assert reuse.reuse_stats()["misses"] == 2
    reuse.clear()


def test_a_stage_of_repeated_blocks_traces_each_distinct_block_once(make_mesh, stack_of,
                                                                    monkeypatch):
    """Lowering a stage of four blocks traces each distinct planned block once (blocks with
    one plan share one trace) and writes every block's parameters into the stage graph."""
    from autopp.lower import stitch
    from autopp.lower.local_graphs import lower_stage

    mesh = make_mesh(2, 2)
    plan, units, ends = _planned_units(stack_of(4), mesh)
    distinct = {(b.signature, b.nodes) for b in plan.blocks}
    assert len(distinct) < len(units), "the test needs repeated block plans"
    traced = []
    real = stitch._trace_piece
    monkeypatch.setattr(stitch, "_trace_piece", lambda *a: traced.append(a[0]) or real(*a))
    local = lower_stage(units, mesh, *ends)
    assert len(traced) == len(distinct), (len(traced), len(distinct))
    assert local.signature.num_params == sum(len(u.joint.params) for u in units)


def test_a_stitched_stage_computes_what_autograd_does(make_mesh, llama_debug):
    """The stage graph written from its units' traces (forward of every block in order,
    then their backward in reverse, one trace shared by the repeated blocks) computes the
    stack's output, every parameter's gradient and the input's gradient as torch's autograd
    does on the same module (a 1 x 1 mesh: no collectives, real tensors; fp32, 1e-5)."""
    import copy

    from autopp.lower.local_graphs import LoweredUnit, lower_stage
    from autopp.sharding import plan_stage
    from tests.harness.stage_request import stage_request
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units
    from tests.harness.parity import assert_parity
    from tests.harness.fake_world import BlockStack

    mesh = make_mesh(1, 1)
    stack = BlockStack(llama_debug, 3)
    x = torch.empty(2, 16, 256, device="meta")
    plan = plan_stage(stage_request(stack, (x,), mesh, output_placements=None))
    units, params, buffers = [], [], []
    torch.manual_seed(0)
    real = copy.deepcopy(stack).to_empty(device="cpu")
    for p in real.parameters():
        torch.nn.init.normal_(p, std=0.05)
    for b in real.buffers():  # the RoPE tables: rotations, as the model's own are
        with torch.no_grad():
            b.copy_(torch.polar(torch.ones_like(b.real), torch.randn_like(b.real)))
    for bplan, unit, real_unit in zip(plan.blocks, stage_units(stack), stage_units(real)):
        joint = trace_joint(unit.module, (x,))
        fqns = tuple(unit.stage_fqn(f) for f in joint.params)
        units.append(LoweredUnit(joint, bplan, fqns, tuple(joint.buffers)))
        params += [real.get_parameter(f) for f in fqns]
        buffers += [real_unit.module.get_buffer(f) for f in joint.buffers]
    ends = (from_strs(plan.input_placements), from_strs(plan.output_placements))
    local = lower_stage(units, mesh, *ends)
    xs, g = torch.randn(2, 16, 256, requires_grad=True), torch.randn(2, 16, 256)
    out, *grads = local.gm(*[p.detach() for p in params], *buffers, xs.detach(), g)
    ref = real(xs)
    ref.backward(g)
    assert_parity(out, ref.detach(), what="stage output")
    for fqn, p, got in zip(local.param_fqns, params, grads[:len(params)]):
        assert_parity(got, p.grad, what=fqn)
    assert_parity(grads[len(params)], xs.grad, what="input gradient")
