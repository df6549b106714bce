"""Tracing: what autopp traces under (this module) and how it traces (the modules of this
package: the joint graph :mod:`.joint`, its process-wide cache :mod:`.cache`, a stage's units
:mod:`.units` and :mod:`.unit_export`, mixed precision :mod:`.precision`).

This module holds registries only: the contexts autopp enters whenever it runs a model on meta
or traces it, the tracing settings (choices that change what is traced), and the call-input
contexts of a block traced alone. The model adapters (:mod:`autopp.adapters`) register here,
and the floors below them (the stage split's checks, the planner's trace) enter the
registrations without importing their owners, so this module sits on the foundations floor
while its siblings sit above ``ops/`` (tests/docs/test_layout.py). ``import autopp`` imports the
adapters first (they are light), so the registrations are in place before any model is split
or traced.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ContextManager

_ON_META: list[Callable[[], ContextManager]] = []


def register(factory: Callable[[], ContextManager]) -> None:
    """Enter ``factory()`` whenever a model runs on meta or is traced. Registering twice is a
    no-op."""
    if factory not in _ON_META:
        _ON_META.append(factory)


def registered() -> tuple[Callable[[], ContextManager], ...]:
    """The registered context factories, in registration order."""
    return tuple(_ON_META)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """The registered contexts, entered in registration order."""
    with contextlib.ExitStack() as stack:
        for factory in _ON_META:
            stack.enter_context(factory())
        yield


# ---- settings that change what is traced ----------------------------------------------------
#
# An adapter's tracing may depend on a choice the user makes (how routed experts exchange
# tokens, the dtype they compute in). Such a choice is a *setting*: the adapter declares it
# with its default and allowed values, ``PlannerOptions`` carries it into a plan (and the plan
# into every later trace of its stages, ``StagePlan.trace_settings``), and the adapter's
# tracing reads it with :func:`setting`. A setting's process-wide default can be changed
# (:func:`set_default`, what the adapters' ``set_...`` functions call); :func:`settings` sets
# values for the code it wraps only.

_DEFAULTS: dict[str, str] = {}
_CHOICES: dict[str, tuple[str, ...]] = {}
_ACTIVE: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "autopp_trace_settings", default=())


def declare(name: str, default: str, choices: tuple[str, ...]) -> None:
    """Declare a setting (once per process; declaring again keeps the current default)."""
    _CHOICES[name] = tuple(choices)
    _DEFAULTS.setdefault(name, check(name, default))


def check(name: str, value: str) -> str:
    """``value`` if it is one of the setting's choices; else a ValueError naming them."""
    if name not in _CHOICES:
        raise KeyError(f"unknown tracing setting {name!r}; declared: {', '.join(_CHOICES)}")
    if value not in _CHOICES[name]:
        raise ValueError(f"{name} {value!r}: expected one of "
                         f"{', '.join(map(repr, _CHOICES[name]))}")
    return value


def set_default(name: str, value: str) -> None:
    """Change a setting's process-wide default (what applies outside :func:`settings`)."""
    _DEFAULTS[name] = check(name, value)


def setting(name: str) -> str:
    """A setting's value here: the innermost :func:`settings` that sets it, else its default."""
    for key, value in reversed(_ACTIVE.get()):
        if key == name:
            return value
    if name not in _DEFAULTS:
        raise KeyError(f"unknown tracing setting {name!r}; declared: {', '.join(_DEFAULTS)}")
    return _DEFAULTS[name]


def current_settings() -> dict[str, str]:
    """Every declared setting's value here, by name (sorted)."""
    return {name: setting(name) for name in sorted(_DEFAULTS)}


@contextlib.contextmanager
def settings(values: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> Iterator[None]:
    """Trace the wrapped code with these setting values (checked against their choices)."""
    items = tuple((values.items() if isinstance(values, Mapping) else values))
    for name, value in items:
        check(name, value)
    token = _ACTIVE.set(_ACTIVE.get() + tuple(items))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# ---- what makes blocks of one structure trace differently -----------------------------------
#
# The planner plans blocks of equal structure (module types, parameter shapes) once. A model
# library whose layers differ by a setting (a layer with a sliding window beside one without)
# registers a function naming those settings; they join the block's signature.

_TRACE_SETTINGS: list[Callable[[Any], tuple]] = []


def register_trace_settings(fn: Callable[[Any], tuple]) -> None:
    """``fn(module)``: hashable settings of ``module`` that change what it traces to (empty
    for modules not of its library). Registering twice is a no-op."""
    if fn not in _TRACE_SETTINGS:
        _TRACE_SETTINGS.append(fn)


def trace_settings(module: Any) -> tuple:
    """The registered settings of ``module`` (empty when none applies)."""
    return tuple(part for fn in _TRACE_SETTINGS for part in fn(module))


# ---- a model call's keyword inputs, for a block run alone ------------------------------------
#
# A model's forward may turn its keyword inputs into state its blocks read rather than pass
# them as block arguments (a transformers model's padding mask and packed documents: a
# forward pre-hook takes them, its attention reads them). The planner traces each block
# alone (a unit called on the stage activation and the step's keyword inputs); it enters
# :func:`call_inputs` there, the contexts the adapters registered to set that state from the
# unit's own inputs, so the traced graph reads them as inputs. While it captures the stage's
# forward at block boundaries (each block one call, its insides not traced), it enters
# :func:`blocks_stand_alone`: the adapters then leave that state unset, as no block body
# is traced there.

_CALL_INPUTS: list[Callable[..., ContextManager | None]] = []
_STAND_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autopp_blocks_stand_alone", default=False)


def register_call_inputs(factory: Callable[..., ContextManager | None]) -> None:
    """``factory(model, kwargs)``: a context that sets what ``model``'s forward would set
    from its keyword inputs ``kwargs`` (name -> tensor) for its blocks, or None when that
    model is not the factory's. Registering twice is a no-op."""
    if factory not in _CALL_INPUTS:
        _CALL_INPUTS.append(factory)


def registered_call_inputs() -> tuple[Callable[..., ContextManager | None], ...]:
    """The registered call-input context factories, in registration order."""
    return tuple(_CALL_INPUTS)


@contextlib.contextmanager
def call_inputs(model: object, kwargs: Mapping[str, object]) -> Iterator[None]:
    """The registered call-input contexts of ``model`` for ``kwargs``, entered in order."""
    with contextlib.ExitStack() as stack:
        for factory in _CALL_INPUTS:
            ctx = factory(model, kwargs)
            if ctx is not None:
                stack.enter_context(ctx)
        yield


@contextlib.contextmanager
def blocks_stand_alone() -> Iterator[None]:
    """While a stage's forward is captured at block boundaries (see above)."""
    token = _STAND_ALONE.set(True)
    try:
        yield
    finally:
        _STAND_ALONE.reset(token)


def standing_alone() -> bool:
    """Whether :func:`blocks_stand_alone` is active here."""
    return _STAND_ALONE.get()
