"""Hugging Face transformers models (``PreTrainedModel``), as they are: what autopp needs to
know about them, and nothing else does.

* **Attention** goes through ``"autopp"`` in transformers' ``AttentionInterface``, set only
  after each distinct call is checked against the model's own
  (:mod:`autopp.adapters.transformers_attention`, which owns the function and its routes).
  transformers gives such an implementation no mask, so what a call masks (a 2-D padding
  mask, or packed documents from restarting ``position_ids``) is taken at the model's call
  by a forward pre-hook (:func:`_take_masks`), or from a block's own inputs when the planner
  traces it alone (:func:`_unit_masks`). Layers that differ by a setting (a sliding window)
  are planned apart (:func:`_trace_settings`).
* **No KV cache**: ``use_cache`` is turned off (a cache object would be a stage output).
* **Initialisation** by the model's own ``_init_weights`` per module, under autopp's per-FQN
  seeds. transformers is imported only when a model of it is given.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autopp import tracing
from autopp.adapters.adapter import Adapter, register
from autopp.adapters.transformers_attention import (
    IMPLEMENTATION, MASKS, attention, check_attention, pushed)


def _pretrained(model: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def _take_masks(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a transformers model: keep what the call masks for the attention
    (:func:`_call_masks`). The entry is pushed first, so the forward hook (which runs even
    when this hook or the forward raises) always pops this call's own entry. While the
    planner captures a stage at block boundaries (:func:`autopp.tracing.blocks_stand_alone`)
    the entry stays empty: no attention is traced there, and each block, traced alone, gets
    its masks from its own inputs (:func:`_unit_masks`)."""
    MASKS.append((None, None))
    masks = _call_masks(model, args, kwargs)
    if not tracing.standing_alone():
        MASKS[-1] = masks


def _call_masks(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What a call of ``model`` masks, after refusing what the attention would not apply:
    its 2-D padding mask (None when there is none or it masks nothing) or, without one, the
    packed documents its ``position_ids`` give (:func:`autopp.ops.attention.packed_documents`;
    None when every row is one document). On meta and fake tensors (planning) nothing is
    read off the values: a given mask or positions always apply."""
    inputs = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs_embeds"))
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        raise ValueError(f"{type(model).__name__}: a 4-D attention_mask (custom mask) is not "
                         "supported; pass the 2-D padding mask (batch, seq)")
    if isinstance(mask, torch.Tensor) and mask.device.type != "meta" and bool(mask.all()):
        mask = None  # nothing padded: plain causal attention (the fused kernel)
    mask = mask if isinstance(mask, torch.Tensor) else None
    documents = None
    positions = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is None and isinstance(positions, torch.Tensor):
        if positions.dim() != 2:
            raise ValueError(f"{type(model).__name__}: position_ids must be (batch, seq), got "
                             f"shape {tuple(positions.shape)}")
        from autopp.ops.attention import packed_documents

        documents = packed_documents(positions)
        if isinstance(inputs, torch.Tensor) and documents.shape[0] != inputs.shape[0]:
            documents = documents.expand(inputs.shape[0], -1)
        if documents.device.type != "meta" and not bool((documents[:, -1] != 0).any()):
            documents = None  # one document a row: plain causal attention
    return mask, documents


def _unit_masks(model: Any, kwargs: Mapping[str, Any]):
    """:func:`autopp.tracing.call_inputs` for a block of ``model`` run alone: the masks its
    call would take from ``kwargs`` (the unit's own inputs), for its attention."""
    if not isinstance(model, nn.Module) or not _pretrained(model) or not kwargs:
        return None
    return pushed(_call_masks(model, (), kwargs))


def _drop_masks(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if MASKS:
        MASKS.pop()


def _prepare(model: nn.Module) -> list[str]:
    if not _pretrained(model):
        return []
    from transformers import AttentionInterface

    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, attention)
    notes = []
    name = type(model).__name__
    if not getattr(model, "_autopp_padding_hooks", False):
        model.register_forward_pre_hook(_take_masks, with_kwargs=True)
        model.register_forward_hook(_drop_masks, with_kwargs=True, always_call=True)
        model._autopp_padding_hooks = True
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    impls = {getattr(c, "_attn_implementation", None) for c in configs.values()}
    check = check_attention(model)  # before the swap: the model's own attention is named
    notes += check.notes
    if check.swap and impls != {IMPLEMENTATION}:
        model.set_attn_implementation(IMPLEMENTATION)
        notes.append(f"transformers {name}: attention {sorted(map(str, impls))} -> "
                     f"{IMPLEMENTATION!r} (the checked routes above)")
    if any(getattr(c, "use_cache", False) for c in configs.values()):
        for c in configs.values():
            if getattr(c, "use_cache", False):
                c.use_cache = False
        notes.append(f"transformers {name}: use_cache -> False (training keeps no KV cache)")
    return notes


def _module_init(root: nn.Module, module: nn.Module):
    if not _pretrained(root):
        return None
    return lambda: root._init_weights(module)


def _trace_settings(module: nn.Module) -> tuple:
    """A transformers module's scalar settings (a layer's ``sliding_window``, ``layer_type``,
    ``is_sliding``): layers of one class that differ in them trace differently. The layer
    index is left out: transformers' layers read it only for the KV cache, unused here."""
    if not type(module).__module__.startswith("transformers."):
        return ()
    return tuple(sorted((k, v) for k, v in vars(module).items()
                        if not k.startswith("_") and k not in ("layer_idx", "training")
                        and isinstance(v, bool | int | float | str | type(None))))


ADAPTER = register(Adapter(name="transformers", prepare=_prepare, module_init=_module_init))
tracing.register_call_inputs(_unit_masks)
tracing.register_trace_settings(_trace_settings)
