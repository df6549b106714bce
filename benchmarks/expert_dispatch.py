"""Token dispatch for routed experts, measured against the cost model: all-to-all vs all-gather.

    .venv/bin/python benchmarks/expert_dispatch.py --world 4 --topk 1 2 4

On ``--world`` gloo processes (experts split over all of them, each with its own tokens) one
training step of the routed-experts op (forward and backward) runs both ways, side by side in
one launch (interleaved repeats, medians):

* all-to-all: ``autopp::routed_experts`` with the world's process group (each token's rows
  go only to its experts' ranks, :mod:`autopp.sharding.options.expert_dispatch`);
* all-gather: tokens, scores and ids all-gathered, the op on every token with the local
  experts, the output reduce-scattered back (the expert-parallel option of the op's DTensor
  rule, as the planner lowers it); the backward's collectives are autograd's (reduce-scatter
  of the input gradients, all-gather of the output gradient).

The prediction is the planner's: its cost model with this machine's measured profile
(:func:`autopp.profiles.measure.measure_profile`) prices the collectives each way takes (the compute
is the same FLOPs both ways, the bytes each touches are not). Printed per top-k: measured
medians and their ratio, and the predicted times and ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _inputs(rank: int, args, k: int):
    g = torch.Generator().manual_seed(1000 + rank)
    t, d, f, e = args.tokens, args.dim, args.hidden, args.experts
    x = torch.randn(1, t, d, generator=g)
    scores = torch.rand(1, t, k, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).view(1, t, k)
    gw = torch.Generator().manual_seed(7)
    n = dist.get_world_size()
    ws = [torch.randn(e, f, d, generator=gw) * 0.05, torch.randn(e, d, f, generator=gw) * 0.05,
          torch.randn(e, f, d, generator=gw) * 0.05]
    local = slice(rank * e // n, (rank + 1) * e // n)
    return x, scores, ids, [w[local].contiguous() for w in ws], torch.arange(e)[local]


def _step_a2a(x, scores, ids, ws, eids, e, group):
    xs, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
    lw = [w.clone().requires_grad_() for w in ws]
    out = torch.ops.autopp.routed_experts(xs, ss, ids, eids, *lw, e, "", "all_to_all", group,
                                          e // dist.get_world_size())
    out.sum().backward()


def _step_gather(x, scores, ids, ws, eids, e, group):
    from torch.distributed import _functional_collectives as fc

    n = dist.get_world_size()
    xs, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
    lw = [w.clone().requires_grad_() for w in ws]
    gx = fc.wait_tensor(fc.all_gather_tensor_autograd(xs, 1, group))
    gs = fc.wait_tensor(fc.all_gather_tensor_autograd(ss, 1, group))
    gi = fc.wait_tensor(fc.all_gather_tensor(ids, 1, group))
    full = torch.ops.autopp.routed_experts(gx, gs, gi, eids, *lw, e, "")
    out = fc.wait_tensor(fc.reduce_scatter_tensor_autograd(full, "sum", 1, group))
    assert out.shape == x.shape and n > 1
    out.sum().backward()


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autopp.ops.experts  # noqa: F401  (registers the op)

    group = dist.group.WORLD.group_name
    out = {}
    for k in args.topk:
        x, scores, ids, ws, eids = _inputs(rank, args, k)
        times = {"all_to_all": [], "all_gather": []}
        steps = {"all_to_all": _step_a2a, "all_gather": _step_gather}
        for i in range(args.repeats + 1):
            for name, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                step(x, scores, ids, ws, eids, args.experts, group)
                dist.barrier()
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
        out[k] = {name: statistics.median(v) for name, v in times.items()}
    queue.put((rank, out))
    dist.destroy_process_group()


def _predicted(args, k: int, profile) -> dict[str, float]:
    """Seconds of one step each way as the planner prices it: the op's forward and backward
    nodes under each option (``CostModel.compute_time``: FLOPs, bytes, and for the
    all-to-all option the exchanges inside its kernel) plus, for the all-gather, the
    redistributions around them."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.fx.experimental.proxy_tensor import make_fx

    import autopp.ops.experts  # noqa: F401  (registers the op)
    from autopp.sharding.cost.model import CostModel
    from autopp.sharding.options.strategies import NodeStrategy, Option, tensor_vals

    n, e = args.world, args.experts
    t = args.tokens * n
    meta = dict(device="meta")
    ins = [torch.empty(1, t, args.dim, **meta), torch.empty(1, t, k, **meta),
           torch.empty(1, t, k, dtype=torch.long, **meta), torch.empty(e, dtype=torch.long, **meta),
           torch.empty(e, args.hidden, args.dim, **meta), torch.empty(e, args.dim, args.hidden, **meta),
           torch.empty(e, args.hidden, args.dim, **meta), torch.empty(1, t, args.dim, **meta)]

    def step(x, s, ids, eids, w1, w2, w3, g):
        y = torch.ops.autopp.routed_experts(x, s, ids, eids, w1, w2, w3, e, "", "auto")
        grads = torch.ops.autopp.routed_experts_backward(g, x, s, ids, eids, w1, w2, w3, e, "",
                                                         "auto")
        return y, grads

    gm = make_fx(step)(*ins)
    fwd, bwd = [nd for nd in gm.graph.nodes if nd.op == "call_function"
                and nd.target in (torch.ops.autopp.routed_experts.default,
                                  torch.ops.autopp.routed_experts_backward.default)]
    costs = CostModel(profile, (n,))
    tok, r, p, ex = (Shard(1),), (Replicate(),), (Partial(),), (Shard(0),)

    def node_time(nd, out, need):
        ns = NodeStrategy(nd, "op", [(a, 0) for a in nd.args if hasattr(a, "meta")])
        return costs.compute_time(ns, Option(tuple(out), tuple(need)))

    a2a = (node_time(fwd, [tok], [tok] * 3 + [ex] * 4)
           + node_time(bwd, [tok, tok, ex, ex, ex], [tok] * 4 + [ex] * 4))
    gather = (node_time(fwd, [p], [r] * 3 + [ex] * 4)
              + node_time(bwd, [p, p, ex, ex, ex], [r] * 4 + [ex] * 4))

    def red(src, dst, nd):
        v = tensor_vals(nd)[0]
        return costs.redistribute(src, dst, tuple(v.shape), v.dtype)[0]

    placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
    x, sc, ids, g = (placeholders[i] for i in (0, 1, 2, 7))
    # forward: tokens, scores, ids gathered, the output reduce-scattered; backward (autograd
    # of those): the output gradient gathered, the input and score gradients reduce-scattered
    gather += red(tok, r, x) + red(tok, r, sc) + red(tok, r, ids) + red(p, tok, fwd)
    gather += red(tok, r, g) + red(p, tok, x) + red(p, tok, sc)
    return {"all_to_all": a2a, "all_gather": gather}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import socket

    import torch.multiprocessing as mp

    from autopp.profiles.measure import measure_profile

    profile = measure_profile(world_size=args.world)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    n = args.world
    print(f"{n} gloo ranks, {args.tokens} tokens x {args.dim} per rank, {args.experts} experts "
          f"({args.experts // n} per rank) of hidden {args.hidden}; profile {profile.name}; "
          f"medians of {args.repeats} steps (forward + backward), slowest rank")
    print(f"{'top-k':>5} {'all-to-all':>11} {'all-gather':>11} {'ratio':>6}   predicted: "
          f"{'all-to-all':>10} {'all-gather':>10} {'ratio':>6}")
    for k in args.topk:
        meas = {w: max(results[r][k][w] for r in results) for w in ("all_to_all", "all_gather")}
        pred = _predicted(args, k, profile)
        print(f"{k:>5} {meas['all_to_all'] * 1e3:>9.2f}ms {meas['all_gather'] * 1e3:>9.2f}ms "
              f"{meas['all_to_all'] / meas['all_gather']:>6.2f}   "
              f"{'':>10} {pred['all_to_all'] * 1e3:>8.2f}ms {pred['all_gather'] * 1e3:>8.2f}ms "
              f"{pred['all_to_all'] / pred['all_gather']:>6.2f}")


if __name__ == "__main__":
    main()
