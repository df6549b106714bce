"""Whole models on the meta device from a name: what the command line (and the example)
plan without weights or devices.

What: :func:`build_meta_model` builds a model from one of three specs: a torchtitan
registry name (``llama3:8B``, ``qwen3:0.6B``, ``deepseek_v3:671B``: the family's
``*_configs`` entry with SDPA attention), a Hugging Face ``config.json`` (transformers'
``AutoModelForCausalLM.from_config``, no weights) or ``module:factory`` (a callable
returning the model, called under ``torch.device("meta")``). Why: planning needs only the
model's structure and shapes. Invariant: every returned parameter is on meta; a spec that
cannot be built raises ValueError saying what to write instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
from pathlib import Path

import torch
from torch import nn

from autopp.extras import import_extra


def torchtitan_families() -> tuple[str, ...]:
    """torchtitan's model families (the packages under ``torchtitan.models``), found
    without importing them."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        return ()
    root = Path(next(iter(spec.submodule_search_locations))) / "models"
    return tuple(sorted(p.name for p in root.iterdir()
                        if (p / "__init__.py").exists() and p.name != "common"))


def torchtitan_configs(family: str) -> dict:
    """The family's registry of configs (``llama3_configs``, ``deepseekv3_configs``, ...)."""
    module = importlib.import_module(f"torchtitan.models.{family}")
    found = [v for k, v in vars(module).items() if k.endswith("_configs") and isinstance(v, dict)]
    if len(found) != 1:
        raise ValueError(f"torchtitan.models.{family} has no single *_configs registry "
                         f"(found {len(found)}); give the model as module:factory instead")
    return found[0]


def torchtitan_model(family: str, flavor: str) -> nn.Module:
    """torchtitan's ``family`` preset ``flavor`` with SDPA attention, on meta."""
    configs = torchtitan_configs(family)
    if flavor not in configs:
        raise ValueError(f"torchtitan's {family} has no flavor {flavor!r}; its flavors: "
                         f"{', '.join(configs)} (write e.g. {family}:{next(iter(configs))})")
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )

    builder = configs[flavor]
    # mixture-of-experts presets take the token exchange's backend: torch's collectives
    # ("standard"), as autopp's planner prices and runs them
    kwargs = ({"moe_comm_backend": "standard"} if "moe_comm_backend" in
              inspect.signature(builder).parameters else {})
    cfg = build_decoder_config_for_backend(builder, "sdpa", **kwargs)
    with torch.device("meta"):
        return cfg.build()


def hf_config_model(path: str | os.PathLike) -> nn.Module:
    """A Hugging Face causal LM from its ``config.json`` (``AutoModelForCausalLM.from_config``
    on meta, SDPA attention, no weights)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--hf-config {path}: no such file; give the path of a model's "
                         "config.json (or of the folder holding it)")
    try:
        json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); give a model's config.json") from None
    transformers = import_extra("transformers", "hf", for_what="--hf-config")
    config = transformers.AutoConfig.from_pretrained(str(path.parent) if path.name ==
                                                     "config.json" else str(path))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def factory_model(spec: str) -> nn.Module:
    """``module:factory``: ``module.factory()`` called on the meta device."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"model {spec!r}: cannot import {module_name!r} ({e}); write a "
                         f"torchtitan name ({', '.join(f'{f}:FLAVOR' for f in torchtitan_families()[:3])}"
                         ", ...), module:factory with an importable module, or --hf-config "
                         "PATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {module_name} has no callable {attr!r}")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {spec!r}: {attr}() returned {type(model).__name__}, not an "
                         "nn.Module")
    return model.to("meta") if any(p.device.type != "meta" for p in model.parameters()) else model


def build_meta_model(spec: str | None = None, *, hf_config: str | os.PathLike | None = None
                     ) -> nn.Module:
    """The model named by ``spec`` (torchtitan ``family:flavor`` or ``module:factory``) or
    by ``hf_config`` (one of the two), on meta."""
    if (spec is None) == (hf_config is None):
        raise ValueError("give the model as one of: a torchtitan name (llama3:8B), "
                         "module:factory, or --hf-config PATH/config.json")
    if hf_config is not None:
        return hf_config_model(hf_config)
    head, sep, tail = spec.partition(":")
    if not sep or not head or not tail:
        raise ValueError(f"model {spec!r}: write family:flavor for a torchtitan model (e.g. "
                         "llama3:8B), module:factory for your own, or --hf-config PATH")
    if head in torchtitan_families():
        return torchtitan_model(head, tail)
    return factory_model(spec)
