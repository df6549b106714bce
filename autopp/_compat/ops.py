"""Private torch kernels autopp's own ops call, and tensor internals (the version counter)."""

from __future__ import annotations

import torch

#: ``torch._grouped_mm``: one matmul per group of rows (offsets ``offs``), the kernel under
#: torchtitan's grouped experts.
grouped_mm = torch._grouped_mm


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (``Tensor._version``), and its local shard's for a
    DTensor summed in: it grows with every in-place write, so a caller can tell whether code
    wrote into a tensor."""
    local = getattr(t, "_local_tensor", None)
    return t._version + (local._version if isinstance(local, torch.Tensor) else 0)
