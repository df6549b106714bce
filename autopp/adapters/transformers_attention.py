"""autopp's attention for transformers models (:func:`attention`, registered as "autopp" in
transformers' ``AttentionInterface``), and the check that decides, before autopp swaps it in,
how each distinct attention call of a model runs, or refuses the model.

A small copy of the model (:func:`small_config`: its attention settings kept, widths, depth and
vocabulary cut, a sliding window shortened so that it acts) runs once on CPU in fp32 with the
model's own attention function and transformers' own masks, recording each distinct call (per
attention class and the keywords it gives, :func:`route_key`). Each is replayed on random
queries and keys large enough that score features act (score spread :data:`SCORE_STD`: logit
softcapping, for one, changes them), forward and backward: (1) autopp's op (:data:`HANDLED`
keywords only), kept if its output and gradients are within :data:`TOLERANCE` of the model's
own; else (2) the model's own attention function given autopp's mask (logged; ``describe()``
shows it); else (3) the model is refused, naming the attention class, its keywords, the
config fields they come from and both differences. The verdicts go to :data:`ROUTES`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


logger = logging.getLogger("autopp")

IMPLEMENTATION = "autopp"


HANDLED = frozenset({"dropout", "scaling", "is_causal", "sliding_window", "softcap",
                     "position_ids"})
"""Keywords of transformers' attention call that autopp's attention implements (``softcap``:
capped scores; ``sliding_window``: in the mask) or takes elsewhere (``position_ids``: packed
documents, read at the model's call). Any other keyword given a value sends that layer to
the model's own attention function (:class:`Route`), once checked."""

@dataclass(frozen=True, kw_only=True)
class Route:
    """How a layer's attention runs: autopp's op (``function`` None;
    :func:`autopp.ops.attention.sdpa`), or the model's own attention ``function`` given
    autopp's mask as an additive one (a feature autopp's op lacks, e.g. attention sinks)."""

    function: Callable | None = None
    name: str = "autopp"


ROUTES: dict[tuple[str, str, frozenset[str]], Route] = {}
"""Verdicts of the attention check (:mod:`autopp.adapters.transformers_attention`): per
(config class, attention module class, keywords outside :data:`HANDLED` the calls give), the
route that reproduced the model's own attention. A call with no verdict is refused."""


def unhandled(kwargs: Mapping[str, Any]) -> frozenset[str]:
    """The keywords of an attention call outside :data:`HANDLED` that carry a value."""
    return frozenset(k for k, v in kwargs.items()
                     if k not in HANDLED and v is not None and v is not False)


def route_key(module: nn.Module, kwargs: Mapping[str, Any]) -> tuple[str, str, frozenset[str]]:
    """The :data:`ROUTES` key of an attention call of ``module`` with ``kwargs``."""
    config = getattr(module, "config", None)
    return (type(config).__qualname__, type(module).__qualname__, unhandled(kwargs))


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None,
              sliding_window: int | None = None, softcap: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (batch, heads, seq, head_dim) query,
    key and value; returns the output as (batch, seq, heads, head_dim) and no weights.
    Runs the route the attention check chose for this layer's call (:data:`ROUTES`)."""
    from autopp.ops.attention import keep_mask  # not at import: `import autopp` stays light

    route = ROUTES.get(route_key(module, kwargs))
    if route is None:
        raise ValueError(
            f"{type(module).__name__}: attention called with "
            f"{sorted(unhandled(kwargs)) or 'only keywords autopp implements'}, which autopp's "
            "attention check has not seen for this model; call autopp.adapters.prepare(model) "
            "on the model before running it (pipeline_autoparallel does)")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    documents = None
    if attention_mask is None and MASKS:
        attention_mask, documents = MASKS[-1]
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"autopp's attention takes a 2-D padding mask (batch, seq), got "
                         f"shape {tuple(attention_mask.shape)}")
    mask = keep_mask(query.shape[2], key.shape[2], device=query.device, causal=causal,
                     key_valid=attention_mask, documents=documents, window=sliding_window)
    if route.function is not None:
        if mask is None and causal:
            q_len, k_len = query.shape[2], key.shape[2]
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(
                k_len - q_len)[None, None]
        additive = None if mask is None else torch.zeros(
            mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
        out, _ = route.function(
            module, query, key, value, additive, dropout=dropout, scaling=scaling,
            is_causal=is_causal, sliding_window=sliding_window, softcap=softcap, **kwargs)
        return out, None
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if mask is not None:
        causal = False  # in the mask
    if softcap:
        if dropout:
            raise ValueError(f"{type(module).__name__}: attention dropout ({dropout}) with "
                             "logit softcapping is not implemented by autopp's attention; "
                             "set the config's attention_dropout to 0")
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        out = torch.ops.autopp.sdpa(query, key, value, causal, scale, False, mask,
                                    float(softcap))[0]
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                             is_causal=causal, dropout_p=dropout,
                                             scale=scaling)
    return out.transpose(1, 2).contiguous(), None


MASKS: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
"""``(padding mask, packed documents)`` of the model calls in progress (innermost last)."""


@contextlib.contextmanager
def pushed(masks: tuple[torch.Tensor | None, torch.Tensor | None]) -> Iterator[None]:
    MASKS.append(masks)
    try:
        yield
    finally:
        MASKS.pop()



TOLERANCE = 1e-4
"""Largest relative difference (‖ours − theirs‖ / ‖theirs‖, output and every gradient) the
check accepts in fp32."""

SCORE_STD = 10.0
"""Spread of the check's attention scores (scale · q·k), so capped or shaped scores differ."""

CHECK_NAME = "autopp_check"
"""The implementation name the small model runs under while its calls are recorded."""

_BUILT_IN = ("sdpa", "flex_attention", "paged|eager", "flash_attention_2",
             "flash_attention_3", "flash_attention_4")
_CHECKED: dict[str, AttentionCheck] = {}
"""The models checked in this process, by model class and config."""
_CHECKED_KEYS: dict[str, list] = {}


def model_attention(module: nn.Module, implementation: str | None) -> Callable:
    """The model's own attention function for ``module``: the one the config named before
    autopp, where the user registered it with transformers' ``AttentionInterface``; else the
    eager function the module's forward falls back to (transformers' definition of the
    model's attention; its sdpa and flash functions compute the same or refuse a feature)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _custom(implementation):
        return ALL_ATTENTION_FUNCTIONS[implementation]
    eager = inspect.unwrap(type(module).forward).__globals__.get("eager_attention_forward")
    return eager if eager is not None else ALL_ATTENTION_FUNCTIONS["sdpa"]


def _custom(implementation: str | None) -> bool:
    """Whether ``implementation`` is an attention function the user registered."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return implementation not in (None, "eager", IMPLEMENTATION, CHECK_NAME, *_BUILT_IN) \
        and implementation in ALL_ATTENTION_FUNCTIONS


def _set(config: Any, name: str, value: Any) -> None:
    try:
        setattr(config, name, value)
    except AttributeError:  # a derived property (e.g. a head dim computed from the width)
        pass


def small_config(config: Any, *, narrow: bool = True) -> Any:
    """``config`` with its attention settings (head dim, query heads per key/value head,
    scaling, caps, window kinds, positions) kept and the rest small: one layer of each kind
    in ``layer_types``, narrow MLPs, a small vocabulary, a sliding window of 4 positions and,
    with ``narrow``, at most two key/value heads (the width follows the heads)."""
    small = copy.deepcopy(config)
    if narrow:
        heads = small.num_attention_heads
        kv = getattr(small, "num_key_value_heads", None) or heads
        head_dim = getattr(small, "head_dim", None) or small.hidden_size // heads
        kv_small = min(kv, 2)
        _set(small, "num_attention_heads", heads // kv * kv_small)
        if getattr(small, "num_key_value_heads", None):
            _set(small, "num_key_value_heads", kv_small)
        if getattr(small, "head_dim", None):
            _set(small, "head_dim", head_dim)
        _set(small, "hidden_size", small.num_attention_heads * head_dim)
    layers = small.num_hidden_layers
    types = list(getattr(small, "layer_types", None) or [])
    keep = max(types.index(t) for t in set(types)) + 1 if types else min(layers, 2)
    for name, value in list(vars(small).items()):  # per-layer lists follow the layer count
        if isinstance(value, list | tuple) and len(value) == layers and layers > keep:
            _set(small, name, type(value)(value[:keep]))
    _set(small, "num_hidden_layers", keep)
    for name, value in list(vars(small).items()):
        if "intermediate_size" in name and isinstance(value, int) and value > 32:
            _set(small, name, 32)
    if getattr(small, "vocab_size", 0) > 128:
        _set(small, "vocab_size", 128)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(small, name, None), int) and getattr(small, name) >= 128:
                _set(small, name, None)
    if isinstance(getattr(small, "sliding_window", None), int) and small.sliding_window > 4:
        _set(small, "sliding_window", 4)
    _set(small, "use_cache", False)
    return small


def _record_calls(model: nn.Module, implementation: str | None) -> tuple[nn.Module, list]:
    """Run a small copy of ``model`` with its own attention and masks; its distinct calls."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    calls: dict[tuple, tuple] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        own = model_attention(module, implementation)
        given = frozenset(k for k, v in kwargs.items() if v is not None and v is not False)
        calls.setdefault((type(module), given),
                         (module, query, key, value, attention_mask, kwargs))
        return own(module, query, key, value, attention_mask, **kwargs)

    masks = implementation if _custom(implementation) and implementation in \
        ALL_MASK_ATTENTION_FUNCTIONS else "eager"  # else the eager function's masks
    AttentionInterface.register(CHECK_NAME, record)
    AttentionMaskInterface.register(CHECK_NAME, ALL_MASK_ATTENTION_FUNCTIONS[masks])
    failures = []
    for narrow in (True, False):  # heads cut where the model allows it, else kept
        calls.clear()
        try:
            config = small_config(model.config, narrow=narrow)
            with torch.device("cpu"):
                small = type(model)(config).float().eval()
            small.set_attn_implementation(CHECK_NAME)
            with torch.no_grad():
                small(input_ids=torch.randint(0, config.vocab_size, (2, 12)))
            return small, list(calls.values())
        except Exception as e:  # noqa: BLE001  (any failure of the copy: try the next)
            failures.append(f"{type(e).__name__}: {e}")
    raise ValueError(
        f"{type(model).__name__}: autopp could not check its attention against the model's "
        f"own: a small copy of the model (its config with fewer layers, a narrower MLP and "
        f"a small vocabulary) failed to run ({'; '.join(failures)}). autopp swaps in only "
        "attention it has checked, so it refuses this model; please report the message")


@torch.enable_grad()
def _difference(run: Callable, module: nn.Module, q, k, v, kwargs, upstream) -> tuple:
    """``run``'s output and the gradients of q, k, v and ``module``'s parameters."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    params = [p for p in module.parameters() if p.requires_grad]
    out = run(module, *leaves, kwargs)
    grads = torch.autograd.grad(out, leaves + params, upstream, allow_unused=True)
    return (out.detach(), *grads)


def _relative(ours: tuple, theirs: tuple) -> float:
    worst = 0.0
    for a, b in zip(ours, theirs):
        if b is None and a is None:
            continue
        if a is None or b is None:
            return float("inf")
        a, b = a.double(), b.double()
        worst = max(worst, float(torch.linalg.vector_norm(a - b)
                                 / max(float(torch.linalg.vector_norm(b)), 1e-12)))
    return worst if worst == worst else float("inf")  # NaN: disagreement


def _replay(call: tuple, implementation: str | None) -> tuple:
    """One recorded call's inputs, made large enough that score features act, and the model's
    own output and gradients on them."""
    module, query, key, value, mask, kwargs = call
    gen = torch.Generator().manual_seed(0)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    std = (SCORE_STD / (scale * query.shape[-1] ** 0.5)) ** 0.5
    q, k = (torch.randn(t.shape, generator=gen) * std for t in (query, key))
    v = torch.randn(value.shape, generator=gen)
    own = model_attention(module, implementation)
    upstream = torch.randn(own(module, q, k, v, mask, **kwargs)[0].shape, generator=gen)
    theirs = _difference(lambda m, a, b, c, kw: own(m, a, b, c, mask, **kw)[0],
                         module, q, k, v, kwargs, upstream)
    return module, q, k, v, kwargs, upstream, theirs


def _verdict(model: nn.Module, calls: list[tuple], implementation: str | None
             ) -> tuple[Route, str]:
    """Replay the recorded calls that share one route key both ways: the first route that
    agrees with the model's own on every one of them, and its note."""
    module, kwargs = calls[0][0], calls[0][5]
    own = model_attention(module, implementation)
    routes = [Route(function=own, name=f"the model's own attention ({own.__module__}."
                                          f"{own.__qualname__}) with autopp's mask")]
    key = route_key(module, kwargs)
    if not key[2]:
        routes.insert(0, Route())
    replays = [_replay(call, implementation) for call in calls]
    tried = []
    for route in routes:
        ROUTES[key] = route
        errors = []
        for module, q, k, v, kwargs, upstream, theirs in replays:
            with pushed((None, None)):
                ours = _difference(
                    lambda m, a, b, c, kw: attention(m, a, b, c, None, **kw)[0],
                    module, q, k, v, kwargs, upstream)
            errors.append((_relative(ours, theirs), module, kwargs))
        error, module, kwargs = max(errors, key=lambda e: e[0])
        tried.append((route.name, error, module, kwargs))
        if error <= TOLERANCE:
            shown = "; ".join(_describe(m, kw) for _, m, kw in errors)
            return route, f"{shown}: {route.name} (difference {error:.1e})"
        del ROUTES[key]
    raise ValueError(_refusal(model, tried))


def _describe(module: nn.Module, kwargs: dict) -> str:
    given = {k: v for k, v in kwargs.items() if v is not None and v is not False}
    shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else
                      f"{k}={v}" if isinstance(v, int | str) else k for k, v in given.items())
    return f"{type(module).__name__}({shown})"


def _refusal(model: nn.Module, tried: list) -> str:
    config = model.config
    module, kwargs = tried[-1][2], tried[-1][3]
    fields = {k for k, v in kwargs.items() if v is not None and v is not False
              and k not in ("dropout", "position_ids")}
    named = sorted(f"{n}={v!r}" for n, v in vars(config).items()
                   if not n.startswith("_") and isinstance(v, int | float | str)
                   and not isinstance(v, bool)
                   and any(isinstance(kwargs.get(f), int | float) and kwargs[f] == v
                           for f in fields))
    masks = sorted(f"{n}={v!r}" for n, v in vars(config).items() if not n.startswith("_")
                   and any(w in n for w in ("window", "chunk", "causal", "bidirectional",
                                            "layer_types", "mask")))
    attempts = "; ".join(f"{name}: {error:.1e}" for name, error, *_ in tried)
    return (f"{type(model).__name__}: autopp's attention does not reproduce the model's own "
            f"for {_describe(module, kwargs)} (relative difference, tolerance {TOLERANCE:g}: "
            f"{attempts}). Config fields behind its keywords: {', '.join(named) or 'none'}; "
            f"mask settings: {', '.join(masks) or 'none'}. Training it would change the "
            "model's numbers, so autopp refuses it; keyword features run as the model's own "
            "function, so the difference is in the mask the model builds")


@dataclass(frozen=True, kw_only=True)
class AttentionCheck:
    """What the check found for one model."""

    notes: tuple[str, ...]
    """Lines for the log and ``describe()``: each kind of call and the route it takes."""
    swap: bool
    """Whether the model calls attention through transformers' attention interface (else
    its own attention code runs as it is, and autopp must not change its implementation)."""


def check_attention(model: nn.Module) -> AttentionCheck:
    """Check every distinct attention call of ``model`` (a transformers model, on any device)
    against the model's own and fill :data:`~autopp.adapters.transformers_ROUTES` (a
    fallback to the model's own function is logged as a warning). Raises ValueError when
    neither route reproduces the model's attention."""
    implementation = getattr(model.config, "_attn_implementation", None)
    try:
        text = model.config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a value JSON cannot hold
        text = repr(sorted(vars(model.config).items(), key=str))
    signature = f"{type(model).__qualname__}:{text}"
    if signature in _CHECKED and all(r in ROUTES for r in _CHECKED_KEYS[signature]):
        return _CHECKED[signature]
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        small, calls = _record_calls(model, implementation)
        groups: dict[tuple, list] = {}
        for call in calls:
            groups.setdefault(route_key(call[0], call[5]), []).append(call)
        verdicts = [_verdict(model, group, implementation) for group in groups.values()]
    name = type(model).__name__
    seconds = time.perf_counter() - start
    notes = [f"transformers {name}: attention checked against the model's own (forward and "
             f"backward, fp32, {len(calls)} kind(s) of call, {seconds:.1f} s): "
             + "; ".join(n for _, n in verdicts)] if calls else [
        f"transformers {name}: no attention call goes through transformers' attention "
        f"interface (checked, {seconds:.1f} s): the model's own attention runs unchanged"]
    for route, note in verdicts:
        if route.function is not None:
            logger.warning("transformers %s: %s: autopp's attention op lacks a feature of "
                           "this call; it runs as the model's own attention (its math, a "
                           "score tensor per head, planned and priced as it runs)", name, note)
    _CHECKED[signature] = AttentionCheck(notes=tuple(notes), swap=bool(calls))
    _CHECKED_KEYS[signature] = [route_key(c[0], c[5]) for c in calls]
    return _CHECKED[signature]

