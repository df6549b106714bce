"""One rank of the gloo lowering test: plan (rank 0), broadcast, lower each block, compare.

Checks, on a 2-block llama3 debugmodel stack planned for a (dp, tp) mesh:
(a) the lowered joint graphs, chained, give the single-process module's output, parameter
    gradients and input gradient;
(b) each graph holds explicit collectives and no DTensor;
(c) the split callables (forward + full backward, and dI then dW) give the joint's values.
Also times one block's forward+backward: DTensor interpreter vs lowered graphs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.lower._apply_worker import build


def _full(local: torch.Tensor, mesh, placements, shape) -> torch.Tensor:
    from autopp.sharding.plan import from_strs

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, from_strs(placements), run_check=False,
                              shape=torch.Size(shape), stride=stride).full_tensor()


def _local(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    from autopp.sharding.plan import from_strs

    return distribute_tensor(full.detach(), mesh, from_strs(placements)).to_local()


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def run_lower(rank: int, world: int, dp: int, tp: int, time_iters: int) -> dict[str, Any]:
    from autopp.sharding import StagePlan, plan_stage
    from tests.harness.stage_request import stage_request
    from autopp.lower.apply import apply_plan
    from autopp.lower.local_graphs import collective_counts, lower_joint, split_local

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    meta_stack = build("meta")
    total = sum(p.numel() * p.element_size() for p in meta_stack.parameters())
    shape = (4, 16, 256)
    x_meta = torch.empty(shape, device="meta")
    text = [None]
    if rank == 0:  # parameter memory forces FSDP/TP-style sharding over all 4 ranks
        plan = plan_stage(stage_request(meta_stack, (x_meta,), mesh, profile="H100",
                                        memory_budget_bytes=total / 4, output_placements=None))
        text = [plan.to_json()]
    dist.broadcast_object_list(text, src=0)
    plan = StagePlan.from_json(text[0])

    ref = build("cpu")
    torch.manual_seed(1)
    x = torch.randn(shape)
    sharded = apply_plan(ref, plan, mesh, (x_meta,))
    blocks = list(sharded.blocks.values())
    xr = x.clone().requires_grad_(True)
    ref_out = ref(xr)
    w = torch.randn(ref_out.shape)
    (ref_out * w).sum().backward()
    ref_params = dict(ref.named_parameters())

    lowered, states = [], []
    for block, bplan in zip(blocks, plan.blocks):
        lj = lower_joint(block._runner.joint, bplan, mesh)
        lowered.append(lj)
        state = [block.params[k].to_local() for k in block._param_names]
        state += [getattr(block, k).to_local() for k in block._buffer_names]
        states.append(state)
    n_in = [lj.signature.num_state_inputs for lj in lowered]
    for a, b in zip(lowered, lowered[1:]):  # the chain's boundaries agree
        assert a.output_placements[0] == b.input_placements[b.signature.num_state_inputs]

    def joint(i: int, x_local, g_local) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(lowered[i].gm(*states[i], x_local, g_local))

    # (a) chained joints: forward with a zero tangent, then backward from the last block
    x_loc = _local(x, mesh, lowered[0].input_placements[n_in[0]])
    acts = [x_loc]
    for i, lj in enumerate(lowered[:-1]):
        acts.append(joint(i, acts[i], torch.zeros(lj.input_shapes[-1]))[0])
    last = lowered[-1]
    g = _local(w, mesh, last.input_placements[-1])
    results: list[list[torch.Tensor]] = [None] * len(lowered)  # type: ignore[list-item]
    tangents: list[torch.Tensor] = [None] * len(lowered)  # type: ignore[list-item]
    for i in reversed(range(len(lowered))):
        tangents[i] = g
        results[i] = joint(i, acts[i], g)
        g = results[i][-1]
    out_full = _full(results[-1][0], mesh, last.output_placements[0], shape)
    errs = {"out": (out_full - ref_out).abs().max().item()}
    gx = _full(g, mesh, lowered[0].output_placements[-1], shape)
    errs["input_grad"] = (gx - xr.grad).abs().max().item()
    for block, lj, res in zip(blocks, lowered, results):
        n = lj.signature.num_params
        for k, (fqn, pg) in enumerate(zip(block._fqns, res[1 : 1 + n])):
            ref_g = ref_params[fqn].grad
            full = _full(pg, mesh, lj.output_placements[1 + k], ref_g.shape)
            errs[fqn] = (full - ref_g).abs().max().item()

    # (b) explicit collectives, no DTensor
    counts = [collective_counts(lj.gm) for lj in lowered]
    dtensor_nodes = sum(
        isinstance(v, DTensor)
        for lj in lowered for node in lj.gm.graph.nodes
        for v in torch.utils._pytree.tree_leaves(node.meta.get("val"))
    )

    # (c) split callables against the joint
    split_errs: dict[str, float] = {}
    peeled = []
    for i, lj in enumerate(lowered):
        sg = split_local(lj)
        peeled.append(sg.unshard_graph is not None)
        n_p, n_b = lj.signature.num_params, lj.signature.num_buffers
        params, buffers = states[i][:n_p], states[i][n_p : n_p + n_b]
        unsharded = sg.unshard_params(params)
        outs, saved = sg.forward_flat(unsharded, buffers, [acts[i]])
        igrads, pgrads = sg.full_backward(None, saved, (tangents[i],))
        pgrads = sg.reduce_grads(pgrads)
        joint_res = results[i]
        split_errs[f"{i}.fwd_bwd"] = _max_diff([*outs, *pgrads, *igrads], joint_res)
        igrads2, live = sg.backward_input(None, saved, (tangents[i],))
        pgrads2 = sg.reduce_grads(sg.backward_weight(live))
        split_errs[f"{i}.dI_dW"] = _max_diff([*pgrads2, *igrads2], [*pgrads, *igrads])

    # timing: block 0 forward+backward, DTensor interpreter vs lowered split graphs
    timings: dict[str, float] = {}
    if time_iters:
        from autopp.sharding.plan import from_strs

        block, lj = blocks[0], lowered[0]
        sg = split_local(lj)
        n_p, n_b = lj.signature.num_params, lj.signature.num_buffers
        params, buffers = states[0][:n_p], states[0][n_p : n_p + n_b]
        xd = DTensor.from_local(acts[0], mesh, from_strs(lj.input_placements[n_in[0]]),
                                run_check=False)
        gd = DTensor.from_local(tangents[0], mesh, from_strs(lj.input_placements[-1]),
                                run_check=False)

        def interp() -> None:
            xi = xd.detach().requires_grad_(True)
            block(xi).backward(gd)

        def graphs() -> None:
            outs, saved = sg.forward_flat(sg.unshard_params(params), buffers, [acts[0]])
            _, pg = sg.full_backward(None, saved, (tangents[0],))
            sg.reduce_grads(pg)

        def joint_gm() -> None:
            joint(0, acts[0], tangents[0])

        for name, fn in (("interpreter", interp), ("lowered_split", graphs),
                         ("lowered_joint", joint_gm)):
            fn()  # warm-up
            ts = []
            for _ in range(time_iters):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            timings[name] = statistics.median(ts)
        block.zero_grad(set_to_none=True)

    return {
        "errs": errs,
        "num_params": len(ref_params),
        "counts": counts,
        "dtensor_nodes": dtensor_nodes,
        "split_errs": split_errs,
        "peeled": peeled,
        "timings": timings,
        "placements": {p.fqn: p.placements for p in plan.params},
        "signatures": [str(lj.signature) for lj in lowered],
    }
