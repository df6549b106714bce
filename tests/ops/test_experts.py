"""The routed-experts op (``autopp::routed_experts``) in one process: the model's own numbers,
its expert-parallel and hidden-split shards summing to the whole, its FLOPs, and a buffer the
forward writes (MoE token counts) kept by the joint trace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopp.ops import experts  # noqa: F401  (registers the op)
from tests.harness.parity import assert_parity

B, L, D, F, E, K = 2, 8, 16, 16, 8, 2


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g)
    scores = torch.rand(B, L, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * L)]).view(B, L, K)
    w1 = torch.randn(E, F, D, generator=g) * 0.2
    w2 = torch.randn(E, D, F, generator=g) * 0.2
    w3 = torch.randn(E, F, D, generator=g) * 0.2
    return x, scores, ids, w1, w2, w3


def _reference(x, scores, ids, w1, w2, w3):
    """Each token's output: sum over its K experts of score * SwiGLU expert(token)."""
    out = torch.zeros_like(x)
    for b in range(B):
        for t in range(L):
            for k in range(K):
                e = int(ids[b, t, k])
                h = torch.nn.functional.silu(w1[e] @ x[b, t]) * (w3[e] @ x[b, t])
                out[b, t] += scores[b, t, k] * (w2[e] @ h)
    return out


def _op(x, scores, ids, w1, w2, w3, expert_ids=None):
    eids = torch.arange(E) if expert_ids is None else expert_ids
    return torch.ops.autopp.routed_experts(x, scores, ids, eids, w1, w2, w3, E, "")[0]


def test_matches_a_hand_written_moe_forward_and_backward():
    args = _inputs()
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    out = _op(*leaves)
    ref_leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    ref = _reference(*ref_leaves)
    assert_parity(out, ref, what="routed experts output")
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for i, (a, r) in enumerate(zip(leaves, ref_leaves)):
        if a.is_floating_point():
            assert_parity(a.grad, r.grad, what=f"gradient of input {i}")


def test_local_experts_read_one_size_from_the_device_each_way():
    """The kernel without dispatch (experts all local, or a slice of them) syncs with the
    host once per forward (the range of rows routed to its experts) and once per backward
    (the same range, read from the forward's routing: no sort)."""
    from autopp.ops.expert_kernels import local_backward
    from autopp.ops.experts import _routed
    from tests.harness.workers.dispatch import HostSyncs

    x, scores, ids, w1, w2, w3 = _inputs()
    for experts in (slice(0, E), slice(2, 5)):
        eids, ws = torch.arange(E)[experts], (w1[experts], w2[experts], w3[experts])
        with HostSyncs() as counter:
            out, order, counts = _routed(x, scores, ids, eids, *ws, E, "")
        assert counter.calls == ["tolist"], counter.calls
        assert out.shape == x.shape
        g = torch.randn_like(out)
        with HostSyncs() as counter:
            local_backward(g, x, scores, ids, eids, *ws, order, counts, "")
        assert counter.calls == ["tolist"], counter.calls
        assert "argsort" not in counter.ops and "sort" not in counter.ops, counter.ops


def test_custom_ops_pass_opcheck():
    """The fake kernels promise the real kernels' shapes, strides and dtypes (the routing
    outputs included), with transposed (non-contiguous) tokens too."""
    x, scores, ids, w1, w2, w3 = _inputs()
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    for xs in (x, xt):
        args = (xs, scores, ids, torch.arange(E), w1, w2, w3, E, "")
        torch.library.opcheck(torch.ops.autopp.routed_experts.default, args)
        out, order, counts = torch.ops.autopp.routed_experts(*args)
        torch.library.opcheck(torch.ops.autopp.routed_experts_backward.default,
                              (torch.randn_like(out), xs, scores, ids, torch.arange(E),
                               w1, w2, w3, order, counts, E, ""))


def test_expert_and_hidden_shards_sum_to_the_whole():
    """What the sharding rule promises: experts split on dim 0 (with their ids) or the
    hidden dim split give partial outputs that sum to the whole, and weight gradients that
    are the whole's slices."""
    x, scores, ids, w1, w2, w3 = _inputs(1)
    whole = _op(x, scores, ids, w1, w2, w3)
    halves = [slice(0, E // 2), slice(E // 2, E)]
    parts = [_op(x, scores, ids, w1[s], w2[s], w3[s], torch.arange(E)[s]) for s in halves]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-6, rtol=1e-5)
    hid = [slice(0, F // 2), slice(F // 2, F)]
    parts = [_op(x, scores, ids, w1[:, s], w2[:, :, s], w3[:, s]) for s in hid]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(whole)
    routing = torch.ops.autopp.routed_experts(x, scores, ids, torch.arange(E), w1, w2, w3, E,
                                              "")[1:]
    full = torch.ops.autopp.routed_experts_backward(g, x, scores, ids, torch.arange(E), w1, w2,
                                                    w3, *routing, E, "")
    for s in halves:
        part = torch.ops.autopp.routed_experts_backward(g, x, scores, ids, torch.arange(E)[s],
                                                        w1[s], w2[s], w3[s], *routing, E, "")
        for got, want in zip(part[2:], full[2:]):
            torch.testing.assert_close(got, want[s], atol=1e-6, rtol=1e-5)


def test_flops_count_the_routed_tokens_on_the_local_experts():
    x, scores, ids, w1, w2, w3 = _inputs()
    with FlopCounterMode(display=False) as counter:
        _op(x, scores, ids, w1[:2], w2[:2], w3[:2], torch.arange(2))
    # B*L*K routed tokens, 2 of 8 experts local: a quarter of them, 3 matmuls of D x F each
    assert counter.get_total_flops() == B * L * K // 4 * 3 * 2 * D * F


def test_torchtitan_moe_traces_with_its_count_as_a_buffer_update():
    pytest.importorskip("torchtitan")
    from autopp.tracing.joint import trace_joint
    from tests.harness.models import qwen3_moe_meta

    block = qwen3_moe_meta(1).layers["0"]
    with torch.device("meta"):
        x = torch.empty(2, 16, block.moe.router.gate.weight.shape[1])
    joint = trace_joint(copy.deepcopy(block), (x, None, None))
    assert list(joint.buffer_updates) == ["moe.tokens_per_expert_E"]
    targets = {str(n.target) for n in joint.gm.graph.nodes}
    assert "autopp.routed_experts.default" in targets
    assert "autopp.routed_experts_backward.default" in targets


def test_expert_bias_update_by_fqn():
    pytest.importorskip("torchtitan")
    from autopp.adapters.torchtitan_moe import update_expert_bias
    from tests.harness.models import deepseek_v3_meta

    from autopp import init_module_

    model = init_module_(deepseek_v3_meta(2), seed=0, device="cpu")
    moe = model.layers["1"].moe
    moe.tokens_per_expert_E.copy_(torch.tensor([4., 0., 2., 2., 1., 3., 2., 2.]))
    update_expert_bias([model], model)
    c = moe.load_balance_coeff
    # mean 2: experts above it lose c, below gain c, at it 0; then centred (sum of signs: 0)
    want = torch.tensor([-c, c, 0., 0., c, -c, 0., 0.])
    torch.testing.assert_close(moe.expert_bias_E, want)
    assert moe.tokens_per_expert_E.sum() == 0


def test_active_parameters_count_k_of_e_routed_experts():
    """Model FLOPs (the search's MFU) use the parameters a token uses: deepseek_v3's debug
    model routes each token to 3 of 8 experts in each MoE layer (layers 1-3 of 4)."""
    pytest.importorskip("torchtitan")
    from autopp import adapters
    from tests.harness.models import deepseek_v3_meta, llama3_meta

    model = deepseek_v3_meta(4)
    total = sum(p.numel() for p in model.parameters())
    experts_per_layer = 3 * 8 * 256 * 256  # w1, w2, w3: 8 experts of 256 x 256
    assert adapters.active_parameters(model) == total - 3 * experts_per_layer * (1 - 3 / 8)
    dense = llama3_meta(2)
    assert adapters.active_parameters(dense) == sum(p.numel() for p in dense.parameters())


def test_a_single_exchanged_row_unpacks_aligned_for_the_grouped_matmul():
    """The backward's exchanges pack rows of several dtypes as bytes; a single row's slice
    is contiguous already, but unpacked it must be a fresh tensor (aligned, strided by its
    own width): the grouped matmul refuses other strides (test_moe once met one row)."""
    from autopp.ops.expert_kernels import _pack, _unpack

    x, g, s = torch.randn(5, D), torch.randn(5, D), torch.rand(5)
    got = _unpack(_pack(x, g, s)[3:4], (x, g, s))
    for a, want in zip(got, (x[3:4], g[3:4], s[3:4])):
        assert torch.equal(a, want) and a.is_contiguous() and a.data_ptr() % 16 == 0
    assert got[1].stride() == (D, 1)
