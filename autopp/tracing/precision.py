"""Mixed precision for planned stages: parameters computed in ``param_dtype`` (e.g. bf16),
gradients reduced in ``reduce_dtype`` (e.g. fp32), masters and optimizer state in fp32.

The policy is torch's FSDP2 :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`, so a
torchtitan user passes what they have. Units are traced through :class:`CastParams`, which
casts floating parameters to ``param_dtype`` at the top of the forward: the casts and their
backward casts are graph nodes the planner prices (gathering after the cast moves half the
bytes); the planner pins every gradient cast to take its input unredistributed
(:func:`autopp.sharding.options.strategies.reduce_after_cast`), so partial gradients are
reduced in ``reduce_dtype``, never in bf16. ``reduce_dtype`` must be the parameters' own
(master) dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def check_policy(policy: MixedPrecisionPolicy | None, module: nn.Module) -> str | None:
    """``param_dtype`` as a string (what plans record), or None for full precision.

    Raises ValueError for parts of the policy autopp does not honour.
    """
    if policy is None or policy.param_dtype is None:
        if policy is not None and policy.reduce_dtype not in (None, torch.float32):
            raise ValueError("mixed_precision: reduce_dtype without param_dtype is not supported")
        return None
    masters = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if policy.reduce_dtype is not None and {policy.reduce_dtype} != masters:
        raise ValueError(
            f"mixed_precision.reduce_dtype={policy.reduce_dtype} must equal the parameters' "
            f"dtype {sorted(map(str, masters))}: gradients are reduced in the master dtype"
        )
    if policy.output_dtype is not None:
        raise ValueError("mixed_precision.output_dtype is not supported; leave it None")
    return str(policy.param_dtype).removeprefix("torch.")


def dtype_of(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


class CastParams(nn.Module):
    """Runs ``module`` with its floating-point parameters cast to ``dtype``.

    Shares ``module``'s children (same parameter objects, same FQNs), so traced graphs name
    parameters exactly as ``module`` does.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self._modules.update(module._modules)
        self._parameters.update(module._parameters)
        self._buffers.update(module._buffers)
        object.__setattr__(self, "_inner", module)
        self._dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = {
            n: (p.to(self._dtype) if p.is_floating_point() else p)
            for n, p in self._inner.named_parameters()
        }
        return torch.func.functional_call(self._inner, params, args, kwargs)


def maybe_cast(module: nn.Module, param_dtype: str | None) -> nn.Module:
    """``module`` itself, or wrapped in :class:`CastParams` for ``param_dtype``."""
    return module if param_dtype is None else CastParams(module, dtype_of(param_dtype))
