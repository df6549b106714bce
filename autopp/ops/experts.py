"""Routed experts of a mixture-of-experts layer as one op, so data-dependent routing plans.

A router has static shapes and plans op by op; the experts after it do not (tokens sorted by
expert, variable counts per expert, scattered back), which no sharding rule covers. So while
autopp traces a unit, the adapter routes them to ``autopp::routed_experts(x, scores, ids,
expert_ids, w1, w2, w3)`` (the local_map approach): one node with a rule of its own, whose
kernel runs torch's grouped matmul on local shards. ``expert_ids`` says which experts the
local weight shards hold, so the kernel needs no rank or mesh. Per mesh dim the rule offers:
replicated; tokens split (data parallel, weight gradients ``Partial``); experts split
(expert parallel, output ``Partial``); the experts' hidden dim split (output ``Partial``).
:mod:`autopp.sharding.options.expert_dispatch` adds all-to-all forms, chosen by ``dispatch``.

Numerics follow torchtitan's ``GroupedExperts`` (stable sort, scores in fp32, deterministic
scatter-add); the backward takes the forward's routing and re-runs only the experts' forward.
FLOPs (``T·K·E_local/E`` routed tokens) are registered with torch's FLOP counter."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils.flop_counter import register_flop_formula

from autopp.ops.expert_kernels import (
    combine,
    dispatched,
    dispatched_backward,
    expert_mlp,
    local_backward,
    local_rows,
    routing,
    sort_routed,
)


def _routed(x: Tensor, scores: Tensor, ids: Tensor, expert_ids: Tensor, w1: Tensor,
            w2: Tensor, w3: Tensor, num_experts: int, compute_dtype: str,
            group_name: str = "", dispatch_block: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The local computation: (output, ``order``, ``counts``; the routing the backward
    reuses, see :mod:`autopp.ops.expert_kernels`). With a ``group_name``, tokens travel to
    their experts' devices by all-to-all (:mod:`autopp.sharding.options.expert_dispatch`)."""
    if group_name:
        return dispatched(x, scores, ids, expert_ids, w1, w2, w3, num_experts, compute_dtype,
                          group_name, dispatch_block)
    b, l, d = x.shape
    k = ids.shape[-1]
    x_td = x.reshape(b * l, d)
    # the local experts are a contiguous run of global ids (a Shard(0) slice of arange(E))
    order, counts = sort_routed(ids.reshape(-1), num_experts)
    lo, n = local_rows(counts, expert_ids)  # the one host sync
    rows = order[lo:lo + n]
    token_of = rows // k
    y = expert_mlp(x_td[token_of], counts[expert_ids], w1, w2, w3, compute_dtype)
    out = combine(y, scores.reshape(-1)[rows], token_of, x_td).reshape(b, l, d)
    return (out, *routing(order, counts, ids))


@torch.library.custom_op("autopp::routed_experts", mutates_args=())
def routed_experts(x: Tensor, scores: Tensor, ids: Tensor, expert_ids: Tensor, w1: Tensor,
                   w2: Tensor, w3: Tensor, num_experts: int, compute_dtype: str,
                   dispatch: str = "auto", group_name: str = "",
                   dispatch_block: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Routed SwiGLU experts on the local shards; see the module docstring. Returns the
    output and the routing its backward reuses (``order`` shaped like ``ids``, ``counts``
    ``(2, num_experts)``, int64; :mod:`autopp.ops.expert_kernels`): callers use ``[0]``.

    ``num_experts`` is the global expert count; ``compute_dtype`` is ``""`` (the
    weights' dtype) or a dtype name the matmuls run in; ``dispatch`` ("auto", "all_to_all"
    or "all_gather") is how the planner may bring tokens to expert-parallel devices
    (:data:`DISPATCHES`). ``group_name`` and ``dispatch_block`` are set only by the runtime
    when the plan dispatches by all-to-all: the process group of the mesh dim the experts
    are split over, and how many experts each of its devices holds at that level."""
    return _routed(x, scores, ids, expert_ids, w1, w2, w3, num_experts, compute_dtype,
                   group_name, dispatch_block)


@routed_experts.register_fake
def _(x, scores, ids, expert_ids, w1, w2, w3, num_experts, compute_dtype, dispatch="auto",
      group_name="", dispatch_block=0):
    return (x.new_empty(x.shape), ids.new_empty(ids.shape, dtype=torch.long),
            ids.new_empty((2, num_experts), dtype=torch.long))


@torch.library.custom_op("autopp::routed_experts_backward", mutates_args=())
def routed_experts_backward(grad: Tensor, x: Tensor, scores: Tensor, ids: Tensor,
                            expert_ids: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                            order: Tensor, counts: Tensor, num_experts: int,
                            compute_dtype: str, dispatch: str = "auto",
                            group_name: str = "", dispatch_block: int = 0
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`routed_experts` w.r.t. x, scores, w1, w2, w3, routed by the
    forward's ``order`` and ``counts``: no sort, no count exchange, one host sync; the
    experts' forward is re-run on their rows (its hidden activations are not saved), and
    with ``group_name`` set the rows travel by two all-to-alls
    (:func:`~autopp.ops.expert_kernels.dispatched_backward` says why not fewer)."""
    if group_name:
        grads = dispatched_backward(grad, x, scores, ids, expert_ids, w1, w2, w3, order,
                                    counts, compute_dtype, group_name, dispatch_block)
    else:
        grads = local_backward(grad, x, scores, ids, expert_ids, w1, w2, w3, order, counts,
                               compute_dtype)
    return tuple(g.contiguous() for g in grads)


@routed_experts_backward.register_fake
def _(grad, x, scores, ids, expert_ids, w1, w2, w3, order, counts, num_experts,
      compute_dtype, dispatch="auto", group_name="", dispatch_block=0):
    return tuple(t.new_empty(t.shape) for t in (x, scores, w1, w2, w3))


def _setup(ctx, inputs, output):
    x, scores, ids, expert_ids, w1, w2, w3, *args = inputs
    _, order, counts = output
    ctx.mark_non_differentiable(order, counts)
    ctx.save_for_backward(x, scores, ids, expert_ids, w1, w2, w3, order, counts)
    ctx.args = tuple(args)


def _backward(ctx, grad, _order_grad, _counts_grad):
    gx, gs, g1, g2, g3 = routed_experts_backward(grad, *ctx.saved_tensors, *ctx.args)
    return (gx, gs, None, None, g1, g2, g3) + (None,) * len(ctx.args)


routed_experts.register_autograd(_backward, setup_context=_setup)

"""How tokens may reach expert-parallel devices: "all_gather" (every device of the mesh dim
gets every token, runs its experts on those routed to them, the output summed back),
"all_to_all" (each token is sent only to the devices holding its experts, and their outputs
back: experts then split over one mesh dim only), "auto" (the planner prices both)."""


# --- sharding rules (per mesh dim; DTensor expands them over the mesh) -----------------------

_R = Replicate()


def _forward_rules(n_args: int):
    """Outputs (out, order, counts), inputs (x, scores, ids, expert_ids, w1, w2, w3, ...).
    ``order`` is placed like ``ids`` (its shape); ``counts`` ``Replicate`` (it is small; a
    device's values are its own: the routing is the op's state between its forward and its
    backward, pinned there (:mod:`autopp.sharding.options.op_hooks`), never redistributed)."""
    tail = [None] * (n_args - 7)  # num_experts, compute_dtype, dispatch, ...
    rules = [([_R] * 3, [_R] * 7 + tail)]
    for tok in (Shard(0), Shard(1)):  # tokens split: batch or sequence
        rules.append(([tok, tok, _R], [tok, tok, tok, _R, _R, _R, _R] + tail))
    # experts split (expert parallel, tokens by all-gather): tokens whole, output summed
    # over the dim; expert_dispatch adds the all-to-all form of this option
    rules.append(([Partial(), _R, _R],
                  [_R, _R, _R, Shard(0), Shard(0), Shard(0), Shard(0)] + tail))
    # hidden dim split inside every expert
    rules.append(([Partial(), _R, _R], [_R, _R, _R, _R, Shard(1), Shard(2), Shard(1)] + tail))
    return rules


def _backward_rules(n_args: int):
    """Outputs the gradients of (x, scores, w1, w2, w3); inputs (grad, x, scores, ids,
    expert_ids, w1, w2, w3, order, counts, ...), the routing placed as the forward's rule of
    the same option gives it."""
    p = Partial()
    tail = [None] * (n_args - 10)
    rules = [([_R] * 5, [_R] * 10 + tail)]
    for tok in (Shard(0), Shard(1)):
        rules.append(([tok, tok, p, p, p], [tok, tok, tok, tok, _R, _R, _R, _R, tok, _R] + tail))
    rules.append(([p, p, Shard(0), Shard(0), Shard(0)],
                  [_R, _R, _R, _R, Shard(0), Shard(0), Shard(0), Shard(0), _R, _R] + tail))
    rules.append(([p, p, Shard(1), Shard(2), Shard(1)],
                  [_R, _R, _R, _R, _R, Shard(1), Shard(2), Shard(1), _R, _R] + tail))
    return rules


@register_sharding(torch.ops.autopp.routed_experts.default)
def _routed_sharding(*args, **kwargs):
    return _forward_rules(len(args))


@register_sharding(torch.ops.autopp.routed_experts_backward.default)
def _routed_backward_sharding(*args, **kwargs):
    return _backward_rules(len(args))


def _expert_flops(x_shape, ids_shape, eids_shape, w1_shape, num_experts) -> int:
    tokens = 1
    for s in x_shape[:-1]:
        tokens *= s
    routed = tokens * ids_shape[-1] * eids_shape[0] / max(num_experts, 1)
    d, f = w1_shape[-1], w1_shape[-2]
    return int(routed * 3 * 2 * d * f)  # w1, w3 (D -> F) and w2 (F -> D)


@register_flop_formula(torch.ops.autopp.routed_experts)
def _routed_flop(x_shape, scores_shape, ids_shape, eids_shape, w1_shape, w2_shape, w3_shape,
                 num_experts, *args, **kwargs) -> int:
    return _expert_flops(x_shape, ids_shape, eids_shape, w1_shape, num_experts)


@register_flop_formula(torch.ops.autopp.routed_experts_backward)
def _routed_backward_flop(grad_shape, x_shape, scores_shape, ids_shape, eids_shape, w1_shape,
                          w2_shape, w3_shape, order_shape, counts_shape, num_experts, *args,
                          **kwargs) -> int:
    # the experts' forward re-run on their rows (1x: its hidden activations are not saved)
    # and their backward (2x)
    return 3 * _expert_flops(x_shape, ids_shape, eids_shape, w1_shape, num_experts)
