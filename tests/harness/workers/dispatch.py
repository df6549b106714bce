"""Worker for tests/sharding/test_expert_dispatch.py (and its host-sync counter for
tests/ops/test_experts.py): the routed-experts op dispatching tokens by all-to-all on
4 gloo ranks, against a dense hand-written MoE computed whole on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

B, L, D, F, E, K = 4, 6, 8, 12, 8, 3


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, L, D, generator=g)
    scores = torch.rand(B, L, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * L)]).view(B, L, K)
    ws = [torch.randn(E, F, D, generator=g) * 0.3, torch.randn(E, D, F, generator=g) * 0.3,
          torch.randn(E, F, D, generator=g) * 0.3]
    return x, scores, ids, ws


def dense_moe(x, scores, ids, w1, w2, w3):
    """Every expert on every token, weighted by the token's score for it (0 if not routed)."""
    h = torch.nn.functional.silu(torch.einsum("bld,efd->eblf", x, w1))
    h = h * torch.einsum("bld,efd->eblf", x, w3)
    y = torch.einsum("eblf,edf->ebld", h, w2)
    weight = (torch.nn.functional.one_hot(ids, E).to(x.dtype) * scores[..., None]).sum(2)
    return torch.einsum("ble,ebld->bld", weight, y)


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that copy a device value to the host (on CUDA each waits for the
    device): reading a tensor as a Python number or list, and ops whose output size
    depends on the data (a boolean index, ``nonzero``, ``bincount``, ``unique``,
    ``masked_select``, ``repeat_interleave`` without ``output_size``). Run on CPU, it counts
    the syncs a CUDA run would make. ``ops`` lists every torch function called, by name
    (the collectives and sorts among them: :meth:`all_to_alls`)."""

    READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__"}
    SIZED = {"nonzero", "bincount", "unique", "masked_select", "argwhere"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.ops: list[str] = []

    def all_to_alls(self) -> int:
        return sum("all_to_all" in op for op in self.ops)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.ops.append(name)
        tensor_index = len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if (name in self.READS or name in self.SIZED
                or (name == "repeat_interleave" and kwargs.get("output_size") is None
                    and len(args) > 1 and isinstance(args[1], torch.Tensor))
                or (name == "__getitem__" and tensor_index)):
            self.calls.append(name)
        return func(*args, **kwargs)


def host_syncs_of_dispatch(x, scores, ids, ws, tok_rows, experts, group, block
                           ) -> dict[str, tuple[list[str], int, bool]]:
    """Per direction ("forward", "backward") of the all-to-all kernels: the host syncs,
    the all-to-alls, and whether anything was sorted."""
    from autopp.ops.expert_kernels import dispatched, dispatched_backward

    args = (x[tok_rows], scores[tok_rows], ids[tok_rows], torch.arange(E)[experts],
            *[w[experts] for w in ws])
    out = {}
    with HostSyncs() as counter:
        y, order, counts = dispatched(*args, E, "", group.group_name, block)
    out["forward"] = counter
    with HostSyncs() as counter:
        dispatched_backward(torch.ones_like(y), *args, order, counts, "", group.group_name,
                            block)
    out["backward"] = counter
    return {k: (c.calls, c.all_to_alls(), any("sort" in op for op in c.ops))
            for k, c in out.items()}


def _case(x, scores, ids, ws, tok_rows, experts, group, block, partial_over):
    """Run the op on this rank's token rows and experts, the output summed over
    ``partial_over``; return (output, grads of x rows, scores rows, weights) and the
    reference's, for the same slices."""
    leaves = [x.clone().requires_grad_(), scores.clone().requires_grad_(),
              *[w.clone().requires_grad_() for w in ws]]
    ref = dense_moe(*leaves[:2], ids, *leaves[2:])
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(g)
    lx = x[tok_rows].clone().requires_grad_()
    ls = scores[tok_rows].clone().requires_grad_()
    lw = [w[experts].clone().requires_grad_() for w in ws]
    out = torch.ops.autopp.routed_experts(
        lx, ls, ids[tok_rows], torch.arange(E)[experts], *lw, E, "", "all_to_all",
        group.group_name, block)[0]
    out.backward(g[tok_rows])
    got = [out.detach(), lx.grad, ls.grad]
    if partial_over is not None:  # partial over that mesh dim: sum it
        for t in got:
            dist.all_reduce(t, group=partial_over)
    got += [w.grad for w in lw]
    want = [ref.detach()[tok_rows], leaves[0].grad[tok_rows], leaves[1].grad[tok_rows]]
    want += [w.grad[experts] for w in leaves[2:]]
    return got, want


def run(rank: int, world_size: int) -> dict:
    import autopp.ops.experts  # noqa: F401  (registers the op)

    x, scores, ids, ws = inputs()
    out = {}
    # 1-D: four devices, two experts and one batch row each
    world = dist.group.WORLD
    out["flat"] = _case(x, scores, ids, ws, slice(rank, rank + 1),
                        slice(2 * rank, 2 * rank + 2), world, 2, None)
    syncs = host_syncs_of_dispatch(x, scores, ids, ws, slice(rank, rank + 1),
                                   slice(2 * rank, 2 * rank + 2), world, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    c0, c1 = mesh.get_coordinate()
    local = slice(2 * (2 * c0 + c1), 2 * (2 * c0 + c1) + 2)  # experts split over (a, b)
    # dispatch over the outer dim; the inner dim splits each device's 4 experts further,
    # tokens whole there (its devices get the same tokens; outputs partial over it)
    out["outer"] = _case(x, scores, ids, ws, slice(2 * c0, 2 * c0 + 2), local,
                         mesh.get_group("a"), 4, mesh.get_group("b"))
    # dispatch over the inner dim inside each outer block of 4 experts (tokens whole over
    # the outer dim; tokens routed to the other block are that block's devices' work)
    out["inner"] = _case(x, scores, ids, ws, slice(2 * c1, 2 * c1 + 2), local,
                         mesh.get_group("b"), 2, mesh.get_group("a"))
    return out, syncs
