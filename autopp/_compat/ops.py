"""Private torch kernels autopp's own ops call, and tensor internals (the version counter)."""

from __future__ import annotations

import torch

#: ``torch._grouped_mm``: one matmul per group of rows (offsets ``offs``), the kernel under
#: torchtitan's grouped experts.
grouped_mm = torch._grouped_mm


def write_token(t: torch.Tensor) -> tuple[int, int, int]:
    """What changes whenever code writes a tensor: its in-place version counter
    (``Tensor._version``, the local shard's too for a DTensor) and the storage it points at
    (an assignment through ``torch.utils.swap_tensors`` or ``.data`` keeps the object and its
    version but moves the storage)."""
    local = getattr(t, "_local_tensor", None)
    local = local if isinstance(local, torch.Tensor) else t
    return t._version, local._version, local.data_ptr()
