"""Keeps torch's autograd engine from starting device threads in a fake-mode backward.

autopp forks planning and probing processes (:mod:`autopp.plan.parallel`,
:mod:`autopp.layout_search.probe_pool`); a child whose parent started the engine's device
threads refuses any backward ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"). The engine starts its threads once, at its first backward; with
torch 2.14.1 (its CUDA build, on a machine without GPUs) a first backward run under
FakeTensorMode, as autopp's traces run, starts eight. :func:`warm` runs a first, real,
one-element CPU backward instead, which on such a machine starts none."""

from __future__ import annotations

import torch

_warmed = False


def warm() -> None:
    """Runs the autograd engine's first backward on a real CPU tensor (once per process)."""
    global _warmed
    if not _warmed:
        _warmed = True
        torch.ones(1, requires_grad=True).sum().backward()
