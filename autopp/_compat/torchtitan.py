"""Every private torchtitan / torch name this integration uses, in one place.

torchtitan 0.3.0 keeps the pipeline split helpers private (``_get_pipeline_metadata``,
``_generate_llm_fqn_per_model_part``); torch keeps a module's state-dict hooks in
``_state_dict_hooks`` / ``_load_state_dict_pre_hooks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn


def torchtitan_stage_fqns(parallel_dims, parallelism, model_config) -> list[list[str]]:
    """The module FQNs per stage torchtitan's own ``pipeline_llm`` would use."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
    )

    if parallelism.module_fqns_per_model_part is not None:
        return [list(s) for s in parallelism.module_fqns_per_model_part]
    n_stages, n_layers, input_weight, output_weight = _get_pipeline_metadata(
        parallel_dims, parallelism, model_config)
    return _generate_llm_fqn_per_model_part(n_stages, n_layers, input_weight, output_weight)


def state_dict_post_hooks(module: nn.Module) -> Iterator[Callable]:
    """``hook(module, state_dict, prefix, local_metadata)`` registered on ``module``."""
    return iter(module._state_dict_hooks.values())


def load_state_dict_pre_hooks(module: nn.Module) -> Iterator[Callable]:
    """Pre-hooks registered on ``module``, called as
    ``hook(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)``
    (torch binds the module)."""
    return iter(module._load_state_dict_pre_hooks.values())


def has_state_dict_hooks(module: nn.Module) -> bool:
    return bool(module._state_dict_hooks or module._load_state_dict_pre_hooks)
