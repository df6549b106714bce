"""autopp::sdpa (attention kept as one op in planned graphs) equals torch's SDPA, forward and
backward, and tracing a block keeps it as one op with its own backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopp.ops.attention  # noqa: F401  (registers autopp::sdpa)
from tests.harness.parity import assert_all_parity, assert_parity


@pytest.mark.parametrize("causal,gqa", [(True, False), (False, False), (True, True)])
def test_sdpa_matches_torch(causal, gqa):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    kv_heads = 2 if gqa else 4
    k = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    ours, _ = torch.ops.autopp.sdpa(q, k, v, causal, 0.3, gqa)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=gqa)
    assert_parity(ours, ref, what="output")
    g = torch.randn_like(ours)
    assert_all_parity(dict(zip("qkv", torch.autograd.grad(ours, (q, k, v), g))),
                      dict(zip("qkv", torch.autograd.grad(ref, (q, k, v), g))),
                      what="gradient")


@pytest.mark.parametrize("gqa", [False, True])
def test_masked_sdpa_is_one_op_and_matches_torch(gqa):
    """A boolean mask per sequence (padding and packed documents, :func:`keep_mask`) is
    traced into ``autopp::sdpa`` (not math attention, no score tensor per head), runs the
    CPU flash kernel forward and backward with torch's SDPA values, passes opcheck, and its
    sharding rule splits the mask with the batch and keeps it whole over heads."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopp.ops.attention import AttentionAsOneOp, keep_mask, packed_documents

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    kv_heads = 2 if gqa else 4
    k = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    valid = torch.ones(2, 16)
    valid[1, :5] = 0  # left padding: query 0 of row 1 attends to nothing
    documents = packed_documents(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6,
                                                7, 8]] * 2))
    mask = keep_mask(16, 16, device=torch.device("cpu"), key_valid=valid, documents=documents)
    assert mask.shape == (2, 1, 16, 16) and mask.dtype == torch.bool

    def attend(q, k, v, mask):
        with AttentionAsOneOp():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    graph = make_fx(attend)(q, k, v, mask).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert "autopp.sdpa.default" in targets and not any("softmax" in t for t in targets)
    ours = attend(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert_parity(ours, ref, what="masked output")
    g = torch.randn_like(ours)
    assert_all_parity(dict(zip("qkv", torch.autograd.grad(ours, (q, k, v), g))),
                      dict(zip("qkv", torch.autograd.grad(ref, (q, k, v), g))),
                      what="masked gradient")
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = torch.ops.autopp.sdpa(q, k, v, False, 0.3, gqa, mask)
    torch.library.opcheck(torch.ops.autopp.sdpa.default, (q, k, v, False, 0.3, gqa, mask))
    torch.library.opcheck(torch.ops.autopp.sdpa_backward.default,
                          (g, q, k, v, out, lse, False, 0.3, gqa, mask))

    from autopp._compat import sharding as compat
    from autopp.ops.attention import _sdpa_sharding

    rules = _sdpa_sharding(None, None, None, False, 0.3, gqa, object())
    on_mask = {str(outs[0]): ins[3] for outs, ins in rules}
    assert on_mask == {"R": compat.Replicate(), "S(0)": compat.Shard(0),
                       "S(1)": compat.Replicate()}


def test_traced_block_keeps_attention_as_one_op(stack_of):
    from autopp.tracing.units import stage_units
    from autopp.tracing.joint import trace_joint

    (unit,) = stage_units(stack_of(1))
    joint = trace_joint(unit.module, (torch.empty(4, 16, 256, device="meta"),))
    targets = [str(n.target) for n in joint.gm.graph.nodes if n.op == "call_function"]
    assert targets.count("autopp.sdpa.default") == 1
    assert targets.count("autopp.sdpa_backward.default") == 1
    assert not any("softmax" in t for t in targets)  # not decomposed into math attention


def test_custom_ops_pass_opcheck_with_transposed_inputs():
    """The fake kernels promise the real kernels' shapes and strides (Inductor checks them:
    a wrong promise fails a compiled planned stage), also for the (batch, seq, heads, dim)
    storage that llama's q/k/v have."""

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8).transpose(1, 2) for _ in range(3))
    g = torch.randn(2, 4, 16, 8)
    out, lse = torch.ops.autopp.sdpa(q, k, v, True, 0.3, False)
    torch.library.opcheck(torch.ops.autopp.sdpa.default, (q, k, v, True, 0.3, False))
    torch.library.opcheck(torch.ops.autopp.sdpa_backward.default,
                          (g, q, k, v, out, lse, True, 0.3, False))


def test_selective_recompute_saves_attention_instead_of_running_it_again(stack_of):
    """Under "selective", autopp::sdpa's output is saved (attention is compute-intensive,
    like the matmuls): the backward recomputes no attention, only the cheap ops."""
    from autopp.graph.recompute import recompute_sets
    from autopp.graph.aot import from_aot_joint
    from autopp.tracing.joint import trace_joint
    from autopp.tracing.units import stage_units

    (unit,) = stage_units(stack_of(1))
    joint = trace_joint(unit.module, (torch.empty(4, 16, 256, device="meta"),))
    flat, sig = from_aot_joint(joint.gm)
    sdpa = [n.name for n in flat.graph.nodes if str(n.target) == "autopp.sdpa.default"]
    assert len(sdpa) == 1
    selective = recompute_sets(flat, sig, "selective")
    assert sdpa[0] in selective.must_save and sdpa[0] not in selective.recomputed
    full = recompute_sets(flat, sig, "full")  # full recompute still re-runs it
    assert sdpa[0] in full.recomputed


def test_backward_is_fused_and_holds_no_seq_by_seq_tensor():
    """The backward runs torch's fused kernel: its gradients equal torch's SDPA autograd to
    float rounding, and the peak allocated during forward + backward at seq 1024 stays
    below one fp32 (batch, heads, seq, seq) tensor (the unfused backward held several),
    measured from the profiler's allocator events as ``benchmarks/memory.py`` measures."""
    from benchmarks.memory import peak_bytes_during

    torch.manual_seed(0)
    b, h, s, d = 1, 2, 1024, 32
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d)

    def ours():
        out, _ = torch.ops.autopp.sdpa(q, k, v, True, d ** -0.5, False)
        return torch.autograd.grad(out, (q, k, v), g)

    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)
    for a, r in zip(ours(), ref):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-6)
    assert peak_bytes_during(ours) < b * h * s * s * 4


def test_causal_attention_is_priced_by_the_pairs_it_computes():
    """The registered FLOPs (what the planner prices) count the (query, key) pairs the
    causal mask keeps, by hand: seq 4 keeps 4 + 3 + 2 + 1 = 10 of 16 pairs; q·kᵀ and p·v
    are 2 FLOPs per pair and head dim each; the fused backward's five matmuls are 2.5
    forwards (the forward is not run again)."""
    from torch.utils.flop_counter import FlopCounterMode

    import autopp.ops.attention  # noqa: F401  (registers autopp::sdpa)

    q = torch.randn(1, 1, 4, 2)
    for causal, pairs in ((False, 16), (True, 10)):
        with FlopCounterMode(display=False) as fc:
            out, lse = torch.ops.autopp.sdpa(q, q, q, causal, 1.0, False)
        assert fc.get_total_flops() == 2 * pairs * (2 + 2), (causal, fc.get_total_flops())
        with FlopCounterMode(display=False) as fc:
            torch.ops.autopp.sdpa_backward(q, q, q, q, out, lse, causal, 1.0, False)
        assert fc.get_total_flops() == int(2.5 * 2 * pairs * 4)
    # a longer query than key (top-left causal): query i sees min(i + 1, 3) of 3 keys
    with FlopCounterMode(display=False) as fc:
        torch.ops.autopp.sdpa(q, q[:, :, :3], q[:, :, :3], True, 1.0, False)
    assert fc.get_total_flops() == 2 * (1 + 2 + 3 + 3) * 4


@pytest.mark.parametrize("gqa", [False, True])
def test_backward_runs_the_fused_backward_from_the_saved_statistics(gqa):
    """Forward + backward run torch's fused CPU kernel once each: the backward reads the
    output and log-sum-exp the forward saved and never runs the forward again (counted by
    the profiler, which sees the aten kernels inside the custom ops)."""
    from torch.profiler import profile

    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    k, v = (torch.randn(2, 2 if gqa else 4, 64, 16, requires_grad=True) for _ in range(2))
    with profile() as prof:
        out, lse = torch.ops.autopp.sdpa(q, k, v, True, 0.25, gqa)
        out.sum().backward()
    calls = {e.key: e.count for e in prof.key_averages() if "flash_attention" in e.key}
    assert calls == {"aten::_scaled_dot_product_flash_attention_for_cpu": 1,
                     "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 1}, calls
    assert lse.shape == (2, 4, 64) and lse.dtype == torch.float32 and not lse.requires_grad
    # the log-sum-exp is the one of each query's (causal, scaled) scores, by hand
    scores = (q @ torch.repeat_interleave(k, 2 if gqa else 1, dim=1).transpose(-2, -1)) * 0.25
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    assert_parity(lse, torch.logsumexp(scores, dim=-1).detach(), what="log-sum-exp")


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                     "CUDNN_ATTENTION"])
@pytest.mark.parametrize("gqa", [False, True])
def test_cuda_entry_points_are_called_as_their_schemas_and_meta_kernels_say(
        monkeypatch, backend, gqa):
    """No GPU here: the CUDA branches run on meta tensors, where torch's meta kernels check
    each private entry point's arguments and give its outputs' shapes (the log-sum-exp
    layouts differ per backend: (b, h, s), padded to 32, (b, h, s, 1)). The op's contract
    holds for each: output (b, h, s, d), log-sum-exp (b, h, s) fp32, gradients shaped like
    q, k, v (grouped-query heads summed back)."""
    from torch.nn.attention import SDPBackend

    from autopp._compat import attention as fused

    monkeypatch.setattr(fused, "fused_backend", lambda *a, **k: getattr(SDPBackend, backend))
    b, h, s, d = 2, 4, 40, 16
    kv = 2 if gqa else 4
    q = torch.empty(b, h, s, d, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(b, kv, s, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse = fused.fused_forward(q, k, v, True, 0.25)
    assert out.shape == (b, h, s, d) and lse.shape == (b, h, s) and lse.dtype == torch.float32
    dq, dk, dv = fused.fused_backward(torch.empty_like(out), q, k, v, out, lse, True, 0.25)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


class _CheckEfficientBias:
    """``torch.ops.aten`` as the CUDA branches call it, the memory-efficient entry points'
    bias checked as the CUDA kernel checks it (its meta kernels check none of it): dtype of
    q; (b, h, s_q, s_k); last dim contiguous; batch, head and query strides multiples of
    the kernel's alignment (16 bytes: 8 bf16 elements, its strictest, sm80+); and, autopp's
    own rule, one bias per sequence expanded over heads (head stride 0, storage
    ``b * s_q * ⌈s_k/16⌉·16`` elements), never a copy per head."""

    NAMES = ("_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_efficient_attention_backward")

    def __init__(self):
        self.biases = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)
        if name not in self.NAMES:
            return op
        backward = name.endswith("backward")

        def checked(*args, **kwargs):
            q, k, bias = (args[1], args[2], args[4]) if backward else (args[0], args[1], args[3])
            assert bias is not None, f"{name} got no bias for a masked call"
            b, h, s_q, s_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            align = 16 // bias.element_size()
            assert bias.dtype == q.dtype and bias.dim() == 4, (bias.dtype, bias.dim())
            assert tuple(bias.shape) == (b, h, s_q, s_k), tuple(bias.shape)
            assert bias.stride(-1) == 1 and bias.stride(1) == 0, bias.stride()
            for dim in (0, 2):
                assert bias.stride(dim) % align == 0, (
                    f"{name}: attn_bias is not correctly aligned (stride({dim}) = "
                    f"{bias.stride(dim)}, not a multiple of {align})")
            aligned = -(-s_k // 16) * 16
            assert bias.untyped_storage().nbytes() == b * s_q * aligned * bias.element_size()
            self.biases.append(bias)
            return op(*args, **kwargs)
        return checked


@pytest.mark.parametrize("gqa", [False, True])
def test_cuda_masked_call_runs_the_efficient_kernel_with_an_aligned_per_sequence_bias(
        monkeypatch, gqa):
    """A boolean mask per sequence on CUDA runs the memory-efficient pair (what torch picks
    for a masked call) with the bias torch's SDPA hands it (``preprocess_mask``), checked on
    meta tensors: the entry points' meta kernels give the outputs' shapes, and the bias is
    checked as the CUDA kernel checks it (:class:`_CheckEfficientBias`). The key length 36
    is not a multiple of 8: an unaligned bias would fail the kernel's stride check."""
    from torch.nn.attention import SDPBackend

    from autopp._compat import attention as fused

    checked = _CheckEfficientBias()
    monkeypatch.setattr(fused, "_aten", checked)
    monkeypatch.setattr(fused, "fused_backend",
                        lambda *a, **k: SDPBackend.EFFICIENT_ATTENTION)
    b, h, s, d = 2, 4, 36, 16
    kv = 2 if gqa else 4
    q = torch.empty(b, h, s, d, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(b, kv, s, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.empty(b, 1, s, s, device="meta", dtype=torch.bool)
    out, lse = fused.fused_forward(q, k, v, False, 0.25, mask)
    assert out.shape == (b, h, s, d) and lse.shape == (b, h, s) and lse.dtype == torch.float32
    dq, dk, dv = fused.fused_backward(torch.empty_like(out), q, k, v, out, lse, False, 0.25,
                                      mask)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert len(checked.biases) == 2  # forward and backward, each with the bias


@pytest.mark.parametrize("masked,efficient_on,efficient_runs,want", [
    (True, True, True, "EFFICIENT_ATTENTION"),  # cuDNN picked for a mask: efficient instead
    (True, True, False, None),  # efficient cannot run these inputs: torch's own SDPA
    (True, False, True, None),  # the user disabled efficient: not forced back on
    (False, True, True, "CUDNN_ATTENTION"),  # no mask: cuDNN driven as torch picks it
])
def test_a_masked_cuda_call_torch_sends_to_cudnn_runs_the_efficient_kernel(
        monkeypatch, masked, efficient_on, efficient_runs, want):
    """On H100 / H200 torch may pick cuDNN for a masked call, whose bias path autopp does
    not drive; the op asks torch again with memory-efficient attention alone, so the call
    stays fused (no forward re-run in the backward). torch's choice is stood in for by its
    rule over the enabled backends (no GPU here): cuDNN when enabled, else efficient where
    it can run."""
    from torch.nn.attention import SDPBackend

    from autopp._compat import attention as fused

    def choice(*args, **kwargs):
        if torch.backends.cuda.cudnn_sdp_enabled():
            return SDPBackend.CUDNN_ATTENTION
        if torch.backends.cuda.mem_efficient_sdp_enabled() and efficient_runs:
            return SDPBackend.EFFICIENT_ATTENTION
        return SDPBackend.MATH

    class _Cuda:  # the backend choice reads only the device type
        device = torch.device("cuda")

    monkeypatch.setattr(fused, "torch_choice", choice)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool) if masked else None
    before = torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_mem_efficient_sdp(efficient_on)
    try:
        got = fused.fused_backend(_Cuda(), _Cuda(), _Cuda(), True, 0.25, mask)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # the user's settings are restored
        assert torch.backends.cuda.mem_efficient_sdp_enabled() == efficient_on
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before)
    assert got == (None if want is None else getattr(SDPBackend, want))


def test_efficient_bias_is_torchs_additive_mask():
    """The bias's values are torch's additive mask (0 where attended, -inf elsewhere, in q's
    dtype), broadcast over heads, whatever storage alignment it has."""
    from autopp._compat import attention as fused

    torch.manual_seed(0)
    mask = torch.rand(2, 1, 5, 21) > 0.3
    q = torch.empty(2, 3, 5, 8, dtype=torch.bfloat16)
    k = torch.empty(2, 3, 21, 8, dtype=torch.bfloat16)
    bias = fused.efficient_bias(mask, q, k)
    want = fused.additive_mask(mask, torch.bfloat16).expand(2, 3, 5, 21)
    assert bias.dtype == torch.bfloat16 and bias.stride() == (5 * 32, 0, 32, 1)
    torch.testing.assert_close(bias, want, rtol=0, atol=0)


def test_masked_calls_are_driven_by_the_kernels_that_take_the_mask():
    """Which of torch's picks the op drives itself: with a mask, the CPU flash and CUDA
    memory-efficient kernels; for cuDNN (or torch's math path) it runs torch's own SDPA."""
    from torch.nn.attention import SDPBackend as B

    from autopp._compat.attention import driven_backend

    for device, backend, masked, want in [
            ("cpu", B.FLASH_ATTENTION, True, B.FLASH_ATTENTION),
            ("cpu", B.MATH, True, None),
            ("cuda", B.EFFICIENT_ATTENTION, True, B.EFFICIENT_ATTENTION),
            ("cuda", B.CUDNN_ATTENTION, True, None),
            ("cuda", B.FLASH_ATTENTION, True, None),
            ("cuda", B.MATH, True, None),
            ("cuda", B.CUDNN_ATTENTION, False, B.CUDNN_ATTENTION),
            ("cuda", B.FLASH_ATTENTION, False, B.FLASH_ATTENTION),
            ("meta", B.FLASH_ATTENTION, False, None)]:
        assert driven_backend(device, backend, masked) == want, (device, backend, masked)


def test_a_fallback_is_logged_as_it_runs_and_counted_as_it_runs(caplog):
    """Where torch picks no kernel the op drives (here its math path, forced), the op runs
    torch's SDPA and its backward runs the forward again: the log line says which inputs,
    what runs and what it costs, and a FLOP count of the run (real tensors) prices that
    path, every (query, key) pair and a backward of 3 forwards, not the fused 2.5."""
    import logging

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from autopp.ops import attention as ops

    ops._UNFUSED_LOGGED.clear()
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with sdpa_kernel(SDPBackend.MATH), caplog.at_level(logging.WARNING, ops.__name__):
        with FlopCounterMode(display=False) as fc:
            out, lse = torch.ops.autopp.sdpa(q, q, q, False, 1.0, False, mask)
        assert fc.get_total_flops() == 2 * 2 * 16 * (8 + 8)
        with FlopCounterMode(display=False) as fc:
            torch.ops.autopp.sdpa_backward(q, q, q, q, out, lse, False, 1.0, False, mask)
        assert fc.get_total_flops() == 3 * 2 * 2 * 16 * (8 + 8)
    (line,) = [r.getMessage() for r in caplog.records]
    for said in ("cpu torch.float64", "(1, 2, 4, 8)", "boolean mask (1, 1, 4, 4)",
                 "its math path", "runs the forward again", "3.0x", "not 2.5x"):
        assert said in line, (said, line)
    assert "picks no fused" not in line


def test_the_planner_prices_attention_as_the_fused_kernels_run(stack_of, make_mesh):
    """On the planner's meta values torch's run-time choice cannot be made: the cost model
    reads the fused kernels' FLOPs (causal pairs, backward 2.5 forwards) from the one
    attention FLOP rule (:func:`autopp.ops.attention.attention_flops`)."""
    from autopp.ops.attention import attention_flops
    from autopp.profiles.lookup import get_profile
    from autopp.sharding.chain.blocks import trace_block
    from autopp.sharding.cost.model import CostModel

    traced = trace_block(stack_of(1), torch.empty(2, 64, 256, device="meta"), make_mesh(2, 2))
    costs = CostModel(get_profile("H100"), (2, 2))
    priced = {}
    for ns in traced.strategies.nodes.values():
        target = str(ns.node.target)
        if target in ("autopp.sdpa.default", "autopp.sdpa_backward.default"):
            q_idx = 0 if target == "autopp.sdpa.default" else 1
            q, k, v = (ns.node.args[q_idx + i].meta["val"] for i in range(3))
            want = attention_flops(q.shape, k.shape, v.shape, True,
                                   backward=q_idx == 1, path="fused")
            priced[target] = (costs.global_flops(ns), want)
    assert len(priced) == 2 and all(got == want > 0 for got, want in priced.values()), priced
