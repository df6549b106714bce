"""Token dispatch by all-to-all for ``autopp::routed_experts`` (expert parallelism).

With experts split over a mesh dim of n devices, the op's plain options gather every token to
every device ((n-1)·T tokens per layer). All-to-all sends each token only where its experts
are, about (n-1)/n·K·T rows each way: less whenever n exceeds the top-k K. The sizes are
data-dependent, so the op's kernel does the exchange, offered through
:mod:`autopp.sharding.options.op_hooks`: options with tokens split on the experts' dims and the output
split like them; a price (two all-to-alls of T·K·D elements and the counts forward, two
backward reusing the forward's routing; routing uniform unless ``expert_imbalance`` prices the
busiest device's compute and rows at that multiple, :func:`imbalance`); routing outputs pinned
so the backward receives them as made; and the local run (:func:`dispatched`).

The kernel follows torchtitan's ``AllToAllTokenDispatcher`` but is written on torch's
functional all-to-all, since torchtitan's takes its group from a mesh wired into the module,
while this op's only handle on the group is its name."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopp import tracing
from autopp._compat import sharding as compat
from autopp.mesh import STAGE_DIMS
from autopp.sharding.options import op_hooks
from autopp.ops import DISPATCHES
from autopp.ops import experts  # noqa: F401  (defines the ops whose hooks follow)
from autopp.sharding.options.option import Option, local_shape, tensor_vals

_FWD = torch.ops.autopp.routed_experts.default
_BWD = torch.ops.autopp.routed_experts_backward.default
_TOKEN_SPLITS = (Shard(0), Shard(1))  # batch or sequence


# --- planner hooks ----------------------------------------------------------------------------


def _layout(node) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
    """(token input positions, expert_ids position, token output positions, position of the
    ``dispatch`` argument) of the forward or backward op; ``num_experts`` is the argument
    before ``compute_dtype``, two before ``dispatch``. The forward's routing ``order`` (an
    output; a backward input) is split like the tokens."""
    if node.target == _FWD:
        return (0, 1, 2), 3, (0, 1), 9
    return (0, 1, 2, 3, 8), 4, (0, 1), 12


def _mode(node) -> str:
    pos = _layout(node)[3]
    mode = node.args[pos] if len(node.args) > pos else node.kwargs.get("dispatch", "auto")
    return mode


def _with(pl: tuple, dim: int, p: Any) -> tuple:
    return tuple(p if i == dim else q for i, q in enumerate(pl))


def dispatch_dims(node, opt: Option) -> tuple[int, ...]:
    """The mesh dims ``opt`` dispatches tokens over by all-to-all (experts and tokens both
    split there; one process group over all of them), or ``()``."""
    tok, eid, _, _ = _layout(node)
    return tuple(d for d, (e, t) in enumerate(zip(opt.ins[eid], opt.ins[tok[0]]))
                 if isinstance(e, Shard) and isinstance(t, Shard))


def _dispatched_form(o: Option, dims: tuple[int, ...], toks: tuple, layout) -> Option:
    tok_in, _, tok_out, _ = layout
    ins, outs = list(o.ins), list(o.out)
    for d, tok in zip(dims, toks):
        for i in tok_in:
            ins[i] = _with(ins[i], d, tok)
        for i in tok_out:
            outs[i] = _with(outs[i], d, tok)
    return Option(tuple(outs), tuple(ins))


def _extra_options(node, options: list[Option], mesh_shape: tuple[int, ...]) -> list[Option]:
    """The op's options as its dispatch allows (:func:`_dispatch_options`), kept to the
    experts' dims ``PlannerOptions.expert_dims`` names (:func:`_pinned`)."""
    return _pinned(node, _dispatch_options(node, options, mesh_shape), mesh_shape, _mode(node))


def _dispatch_options(node, options: list[Option], mesh_shape: tuple[int, ...]
                      ) -> list[Option]:
    """DTensor's options plus their all-to-all forms ("auto"); only the all-to-all forms
    ("all_to_all": expert parallel as torchtitan's EP); DTensor's alone ("all_gather").

    The all-to-all forms of an option whose experts are split over mesh dims ``D`` (tokens
    whole there, output ``Partial``): over each dim of ``D`` alone (the others keep
    gathering), and, with two or more, over all of ``D`` at once (one group of their
    devices, the flattened mesh :func:`autopp.build_world_mesh` makes)."""
    mode = _mode(node)
    if mode not in DISPATCHES:
        raise ValueError(f"routed experts: dispatch={mode!r}; expected one of "
                         f"{', '.join(DISPATCHES)}")
    if mode == "all_gather":
        return options
    layout = _layout(node)
    tok_in, eid, tok_out, _ = layout
    added = []
    for o in options:
        ep = tuple(d for d, p in enumerate(o.ins[eid])
                   if isinstance(p, Shard) and mesh_shape[d] > 1
                   and isinstance(o.ins[tok_in[0]][d], Replicate)
                   and isinstance(o.out[tok_out[0]][d], Partial))
        groups = [(d,) for d in ep] + ([ep] if len(ep) > 1 else [])
        for dims in groups:
            for toks in itertools.product(_TOKEN_SPLITS, repeat=len(dims)):
                added.append(_dispatched_form(o, dims, toks, layout))
    if mode == "all_to_all":
        if not added:
            e = tensor_vals(node.args[eid])[0].shape[0]
            raise ValueError(f"token dispatch 'all_to_all' splits the {e} experts over the "
                             f"mesh, but no dim of {mesh_shape} above 1 divides them with the "
                             "tokens; use set_token_dispatch('auto')")
        return list(dict.fromkeys(added))
    return options + [o for o in dict.fromkeys(added) if o not in options]


def _pinned(node, options: list[Option], mesh_shape: tuple[int, ...], mode: str
            ) -> list[Option]:
    """``options`` whose experts are split over exactly the stage-mesh dims the
    ``expert_dims`` setting names (``PlannerOptions.expert_dims``; with dispatch
    "all_to_all", tokens exchanged over exactly those dims too: torchtitan's EP over that
    group); all of them under "auto"."""
    want = tracing.setting("expert_dims")
    if want == "auto":
        return options
    names = want.split("*")
    dims = tuple(STAGE_DIMS.index(n) for n in names)
    _, eid, _, _ = _layout(node)
    e = tensor_vals(node.args[eid])[0].shape[0]
    small = [n for n, d in zip(names, dims) if d >= len(mesh_shape) or mesh_shape[d] == 1]
    if small:
        raise ValueError(f"expert_dims={want!r} splits the {e} routed experts over "
                         f"{' and '.join(small)}, which has 1 device on this stage mesh "
                         f"{dict(zip(STAGE_DIMS, mesh_shape))}: name dims above 1, or 'auto'")
    kept = [o for o in options
            if tuple(d for d, p in enumerate(o.ins[eid]) if isinstance(p, Shard)
                     and mesh_shape[d] > 1) == dims
            and (mode != "all_to_all" or dispatch_dims(node, o) == dims)]
    if not kept:
        raise ValueError(f"expert_dims={want!r}: no plan splits the {e} routed experts over "
                         f"{' x '.join(names)} ({math.prod(mesh_shape[d] for d in dims)} "
                         f"devices) with token_dispatch={mode!r}: the devices must divide "
                         "the experts; use other dims, or 'auto'")
    return kept


def _collectives(node, opt: Option, mesh_shape: tuple[int, ...]
                 ) -> list[tuple[str, tuple[int, ...], float]]:
    dims = dispatch_dims(node, opt)
    if not dims:
        return []
    _, eid, _, _ = _layout(node)
    xi = 1 if node.target == _BWD else 0  # the backward's first input is the gradient
    x, ids = tensor_vals(node.args[xi])[0], tensor_vals(node.args[xi + 2])[0]
    shape = local_shape(x.shape, opt.ins[xi], mesh_shape)
    rows = math.prod(shape[:-1]) * ids.shape[-1] * imbalance()
    row_bytes = rows * x.shape[-1] * x.element_size()
    if node.target == _FWD:  # the counts, tokens out, outputs back
        counts = tensor_vals(node.args[eid])[0].numel() * 8
        return [("all_to_all", dims, counts)] + [("all_to_all", dims, row_bytes)] * 2
    # the backward reuses the forward's counts: tokens, output gradients and scores out,
    # token and score gradients back (dispatched_backward)
    score_bytes = rows * tensor_vals(node.args[xi + 1])[0].element_size()
    return [("all_to_all", dims, 2 * row_bytes + score_bytes),
            ("all_to_all", dims, row_bytes + score_bytes)]


def imbalance() -> float:
    """The busiest expert-parallel device's routed tokens over the mean, as planned."""
    return float(tracing.setting("expert_imbalance"))


def _busiest_share(node, opt: Option) -> float:
    """With experts split over some mesh dim, the busiest device's share of the expert
    compute over the even split's (:func:`imbalance`); 1 where each device holds them all."""
    _, eid, _, _ = _layout(node)
    return imbalance() if any(isinstance(e, Shard) for e in opt.ins[eid]) else 1.0


def _local_call(node, opt: Option, mesh):
    dims = dispatch_dims(node, opt)
    if not dims:
        return None
    _, eid, _, mode_at = _layout(node)
    num_experts = node.args[mode_at - 2]
    split = math.prod(mesh.shape[e] for e in range(max(dims) + 1)
                      if isinstance(opt.ins[eid][e], Shard))
    if len(dims) == 1:
        group = mesh.get_group(dims[0]).group_name
    else:
        names = [mesh.mesh_dim_names[d] for d in dims]
        group = compat.flattened_group_name(mesh, names)
        if group is None:
            raise ValueError(f"the plan dispatches tokens over mesh dims {names} together, "
                             "which needs their flattened process group: build the mesh "
                             "with autopp.build_world_mesh")
    return functools.partial(node.target, group_name=group, dispatch_block=num_experts // split)


op_hooks.register(_FWD, op_hooks.OpHooks(_extra_options, _collectives, _local_call,
                                         busiest_share=_busiest_share))
op_hooks.register(_BWD, op_hooks.OpHooks(_extra_options, _collectives, _local_call,
                                         pinned=(8, 9), busiest_share=_busiest_share))
