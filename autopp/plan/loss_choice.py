"""The last stage's loss placement: on gathered logits ("batch") or in parallel over tp on
logits split on the vocabulary ("vocab"), what each costs, and how a plan describes it."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh


def loss_kinds(sub_mesh: DeviceMesh, loss_fn: Any, loss_parallel: bool | None) -> tuple[str, ...]:
    """The last stage's output placements to compare: "batch" (logits gathered over tp)
    and, where the loss can run in parallel, "vocab" (see :mod:`autopp.sharding.cost.loss`).

    ``loss_parallel``: None = choose by cost when ``loss_fn`` is :func:`autopp.cross_entropy`,
    True = always (raises unless it is and tp > 1), False = never.
    """
    from autopp.loss import cross_entropy

    tp = sub_mesh["tp"].size()
    able = loss_fn is cross_entropy and tp > 1
    if loss_parallel is True and not able:
        raise ValueError(
            "loss_parallel=True needs loss_fn=autopp.cross_entropy and tp > 1 "
            f"(got tp={tp}, loss_fn={getattr(loss_fn, '__name__', loss_fn)!r}); pass "
            "loss_parallel=None to let the planner decide"
        )
    if loss_parallel is False or not able:
        return ("batch",)
    return ("vocab",) if loss_parallel else ("batch", "vocab")


def describe_loss(kind: str) -> str:
    """The plan report's line on how the last stage computes the loss."""
    if kind == "vocab":
        return "loss parallel: logits stay split on the vocabulary over tp (no gather)"
    return "loss on logits gathered over tp"


def loss_time_s(logits: torch.Tensor, sub_mesh: DeviceMesh, profile: str, kind: str) -> float:
    """Estimated fwd+bwd seconds of the loss on ``logits`` (dp-global, meta) in placement
    ``kind`` ("vocab": loss parallel; else on gathered logits); 0 for non-logit outputs."""
    from autopp.sharding.cost.loss import cross_entropy_time_s

    if not (logits.is_floating_point() and logits.ndim >= 2):
        return 0.0
    return cross_entropy_time_s(logits, tuple(sub_mesh.shape), tuple(sub_mesh.mesh_dim_names),
                                profile, parallel=kind == "vocab")
