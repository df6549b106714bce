"""Attention forward + backward on CPU: autopp's op against torch's own SDPA under autograd
and against the op's two previous backwards: the one that ran torch's SDPA forward again
under autograd (before the op saved its output and log-sum-exp, 2026-12-05), and the
unfused one (probabilities recomputed in fp32 matmuls).

    .venv/bin/python benchmarks/attention.py --seq 2048 --heads 8 --dim 64

For each: the peak of tensor bytes allocated during one forward + backward (the profiler's
allocator events, which also see a fused kernel's scratch: :func:`peak_bytes_during` of
``benchmarks/memory.py``), the median time of ``--repeats`` runs side by side in one
process, and the largest difference of the gradients from torch's; then the backward op's time over
the forward op's, and the causal forward's over the full one's, measured and as the cost
model prices them (their registered FLOPs). The previous backwards are written out here
only to measure them (they are what ``autopp::sdpa_backward`` ran before).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from memory import peak_bytes_during  # noqa: E402

import autopp.ops.attention  # noqa: E402,F401  (registers autopp::sdpa)


def unfused_backward(grad, q, k, v, scale):
    """The op's previous backward: causal probabilities in fp32, then the gradients."""
    qf, kf, vf, gf = q.float(), k.float(), v.float(), grad.float()
    scores = (qf @ kf.transpose(-2, -1)) * scale
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    dv = probs.transpose(-2, -1) @ gf
    dprobs = gf @ vf.transpose(-2, -1)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    return (dscores @ kf) * scale, (dscores.transpose(-2, -1) @ qf) * scale, dv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    g = torch.randn(shape)
    scale = args.dim ** -0.5

    def torch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return torch.autograd.grad(out, (q, k, v), g)

    def autopp_op():
        out, _ = torch.ops.autopp.sdpa(q, k, v, True, scale, False)
        return torch.autograd.grad(out, (q, k, v), g)

    def forward_again():
        with torch.no_grad():
            torch.ops.autopp.sdpa(q, k, v, True, scale, False)
        return torch_sdpa()

    def previous():
        with torch.no_grad():
            torch.ops.autopp.sdpa(q, k, v, True, scale, False)
            return unfused_backward(g, q.detach(), k.detach(), v.detach(), scale)

    ref = torch_sdpa()
    rows = []
    for name, fn in (("torch SDPA autograd", torch_sdpa), ("autopp::sdpa (fused bwd)", autopp_op),
                     ("bwd re-running the fwd", forward_again),
                     ("previous unfused bwd", previous)):
        got = fn()
        err = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        peak = peak_bytes_during(fn)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rows.append((name, peak, statistics.median(times), err))
    def median_s(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    qd, kd, vd = q.detach(), k.detach(), v.detach()
    fwd = median_s(lambda: torch.ops.autopp.sdpa(qd, kd, vd, True, scale, False))
    out, lse = torch.ops.autopp.sdpa(qd, kd, vd, True, scale, False)
    bwd = median_s(lambda: torch.ops.autopp.sdpa_backward(g, qd, kd, vd, out, lse, True, scale,
                                                          False))
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc_f:
        torch.ops.autopp.sdpa(qd, kd, vd, True, scale, False)
    with FlopCounterMode(display=False) as fc_b:
        torch.ops.autopp.sdpa_backward(g, qd, kd, vd, out, lse, True, scale, False)
    priced = fc_b.get_total_flops() / fc_f.get_total_flops()
    seq2 = args.batch * args.heads * args.seq ** 2 * 4
    print(f"attention fwd+bwd, causal, fp32, (b, h, s, d) = {shape}; one fp32 (b, h, s, s) "
          f"tensor is {seq2 / 2**20:.0f} MiB; {torch.get_num_threads()} threads")
    print(f"{'':26} {'peak MiB':>9} {'median ms':>10} {'max |grad - torch|':>19}")
    for name, peak, t, err in rows:
        print(f"{name:26} {peak / 2**20:>9.1f} {t * 1e3:>10.1f} {err:>19.2e}")
    print(f"autopp::sdpa_backward / autopp::sdpa: measured {bwd / fwd:.2f}x "
          f"({bwd * 1e3:.1f} / {fwd * 1e3:.1f} ms), priced {priced:.2f}x (registered FLOPs)")
    # the causal mask: the fused kernels skip masked blocks, priced by the pairs kept
    full = median_s(lambda: torch.ops.autopp.sdpa(qd, kd, vd, False, scale, False))
    with FlopCounterMode(display=False) as fc_full:
        torch.ops.autopp.sdpa(qd, kd, vd, False, scale, False)
    print(f"causal / full forward: measured {fwd / full:.2f}x ({fwd * 1e3:.1f} / "
          f"{full * 1e3:.1f} ms), priced {fc_f.get_total_flops() / fc_full.get_total_flops():.2f}x")


if __name__ == "__main__":
    main()
