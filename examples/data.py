"""Byte-level text data for the examples: every byte is a token (vocab 0..255).

The default corpus is the Python standard library's own sources, which every machine with
Python has: its ``.py`` files in sorted order, concatenated and capped at a few MB, so every
rank (and every machine) reads the same bytes. ``path`` swaps in any file instead.

Batches are sampled deterministically from ``(seed, step)`` alone, so the global batch of a
step is the same whatever the data-parallel degree; each dp rank takes its rows of it.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

#: Tokens are bytes.
VOCAB_SIZE = 256


def stdlib_sources(max_bytes: int) -> bytes:
    """The standard library's .py files in sorted order, concatenated, at most ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_corpus(path: str | None = None, max_bytes: int = 4 << 20) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor: ``path``'s bytes, or the stdlib's sources."""
    data = Path(path).read_bytes()[:max_bytes] if path else stdlib_sources(max_bytes)
    if len(data) < 1024:
        raise ValueError(f"corpus too small ({len(data)} bytes){f' in {path}' if path else ''}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class ByteBatches:
    """Random windows of a byte corpus, as next-token (inputs, labels) pairs.

    The corpus is split once: the first ``1 - eval_fraction`` trains, the rest evaluates.
    """

    corpus: torch.Tensor
    """1-D uint8 tensor of bytes."""
    seq_len: int
    """Tokens per sample fed to the model (windows are ``seq_len + 1`` bytes)."""
    global_batch: int
    """Samples per step summed over all dp ranks."""
    seed: int = 0
    eval_fraction: float = 0.05

    def _windows(self, step: int, split: str) -> torch.Tensor:
        cut = int(len(self.corpus) * (1 - self.eval_fraction))
        lo, hi = (0, cut) if split == "train" else (cut, len(self.corpus))
        span = hi - lo - (self.seq_len + 1)
        if span <= 0:
            raise ValueError(f"{split} split too small for seq_len {self.seq_len}")
        salt = 0 if split == "train" else 1
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 2 + salt)
        starts = lo + torch.randint(0, span, (self.global_batch,), generator=g)
        offsets = torch.arange(self.seq_len + 1)
        return self.corpus[starts[:, None] + offsets].long()

    def get(
        self, step: int, dp_rank: int = 0, dp_size: int = 1, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's rows of the step's global batch: ``(inputs, labels)``, each
        ``(global_batch // dp_size, seq_len)`` int64, labels being inputs shifted by one."""
        if self.global_batch % dp_size:
            raise ValueError(f"global batch {self.global_batch} not divisible by dp={dp_size}")
        rows = self.global_batch // dp_size
        tokens = self._windows(step, split)[dp_rank * rows : (dp_rank + 1) * rows]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
