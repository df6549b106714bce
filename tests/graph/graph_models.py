"""Shared llama3 debugmodel helpers for the autopp.graph tests (CPU, fp32, SDPA)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, VOCAB = 256, 2048


def build_llama(n_layers: int = 6, seed: int = 0) -> nn.Module:
    """torchtitan llama3 debugmodel with SDPA, real fp32 weights on CPU, first n_layers kept."""
    from torchtitan.experiments.graph_trainer.common_utils import build_decoder_config_for_backend
    from torchtitan.models.llama3 import llama3_configs

    cfg = build_decoder_config_for_backend(llama3_configs["debugmodel"], "sdpa")
    with torch.device("meta"):
        model = cfg.build()
    for name in list(model.layers.keys())[n_layers:]:
        del model.layers[name]
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def prune(model: nn.Module, layers: list[str], *, first: bool, last: bool) -> nn.Module:
    """A pipeline stage of ``model``: the given layers, embeddings if first, head if last."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if name not in layers:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.lm_head = None
    return stage


class Blocks(nn.Module):
    """Some llama3 blocks called as ``block(x, None, None)``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, None, None)
        return x


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)
