"""Private torch kernels autopp's own ops call."""

from __future__ import annotations

import torch

#: ``torch._grouped_mm``: one matmul per group of rows (offsets ``offs``), the kernel under
#: torchtitan's grouped experts.
grouped_mm = torch._grouped_mm
