"""Joint graphs of planned units reused within a process.

Applying a plan (:func:`autopp.lower.apply.planned_units`) and pricing it
(:func:`autopp.estimate.stage_costs.stage_facts`) re-trace each unit, and a process builds
the same units again and again (every stage's blocks, another schedule, an eval pipeline).
:func:`traced_unit` serves a trace again where the unit's trace key is unchanged: its
submodules' classes and code (functions by code object, defaults and closures), their
attributes by value and hooks, parameters' and buffers' shapes, dtypes, strides and
``requires_grad``, the inputs, the parameter dtype, tracing settings and contexts, and torch's
default dtype. Not the plan's signature: a changed model traces again, so
:func:`autopp.lower.apply.check_planned_graph` still sees it. A value it cannot compare by
value leaves the unit uncached; code patched outside the unit's classes between two builds is
not seen. Callers share a served graph read-only."""

from __future__ import annotations

import dataclasses
import enum
import logging
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn

from autopp import tracing
from autopp._compat import sharding as compat
from autopp.tracing.joint import JointGraph, trace_joint

logger = logging.getLogger(__name__)

#: Traces kept per process (graphs of fake-tensor metadata, no tensor data).
CAPACITY = 32

_traced: OrderedDict[tuple, JointGraph] = OrderedDict()
_stats = {"hits": 0, "misses": 0, "uncached": 0}

#: nn.Module's own attributes that do not change a trace (what the walk reads elsewhere, or
#: state-dict plumbing), and fx.GraphModule's (its code stands for them).
_SKIPPED_ATTRS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_param_init",  # initialisers: run by init, not traced
    "_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras",
    "meta", "shape_env", "_create_node_hooks", "_deepcopy_hooks", "_erase_node_hooks",
    "_replace_hooks",
    "_call_inputs",  # a unit's call-input contexts: keyed by the registered ones (env)
})
#: A module's hook tables (hook id -> hook), with the tables of per-hook flags keyed by the
#: same ids: a hook is keyed by its place in the table, not by its id (new per module).
_HOOKS = {"_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
          "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
          "_backward_pre_hooks": (), "_backward_hooks": ()}
_HOOK_ATTRS = frozenset(_HOOKS) | {f for flags in _HOOKS.values() for f in flags}
_CLASS_DUNDERS = frozenset({"__dict__", "__weakref__", "__doc__", "__module__",
                            "__qualname__", "__annotations__", "__firstlineno__",
                            "__static_attributes__", "__slots__"})


class _Uncacheable(Exception):
    """A value the trace key cannot compare by value."""


def traced_unit(module: nn.Module, example_inputs: tuple[Any, ...], *,
                prepare: Callable[[nn.Module], nn.Module] = lambda m: m,
                param_dtype: str | None = None, differentiable: int | None = None
                ) -> JointGraph:
    """``trace_joint(prepare(module), example_inputs)``, served from this process's earlier
    traces where one has the same trace key (see the module's docstring). ``prepare`` (e.g. a
    meta copy, a cast to ``param_dtype``) must keep parameter and buffer shapes and, apart
    from the cast to ``param_dtype`` (part of the key), dtypes. ``differentiable``: as
    :func:`~autopp.tracing.joint.trace_joint` takes it."""
    try:
        key = (trace_key(module, example_inputs, param_dtype), differentiable)
    except _Uncacheable as e:
        _stats["uncached"] += 1
        logger.debug("unit %s traced uncached: %s", type(module).__name__, e)
        return trace_joint(prepare(module), example_inputs, differentiable)
    joint = _traced.get(key)
    if joint is not None:
        _traced.move_to_end(key)
        _stats["hits"] += 1
        return joint
    _stats["misses"] += 1
    joint = trace_joint(prepare(module), example_inputs, differentiable)
    _traced[key] = joint
    while len(_traced) > CAPACITY:
        _traced.popitem(last=False)
    return joint


def plainest(modules: Sequence[nn.Module]) -> nn.Module:
    """The first of ``modules`` (units with one plan signature, e.g. a stage's blocks) that
    carries no module hooks anywhere in its tree, else the first. Its trace key is the one
    every plain copy shares, so a trace made while planning serves it: a stage's first and
    last blocks carry the stage cut's hooks (:class:`autopp.stage_split.build.StageCut`),
    which are in their keys."""
    for m in modules:
        if not any(any(vars(sub).get(t) for t in _HOOKS) for sub in m.modules()):
            return m
    return modules[0]


def plainest_by(pairs: Iterable[tuple[Hashable, nn.Module]]) -> dict[Hashable, nn.Module]:
    """``{key: plainest(modules of that key)}`` over ``(key, module)`` pairs in order (e.g.
    a stage plan's units by their plan signature)."""
    groups: dict[Hashable, list[nn.Module]] = {}
    for key, module in pairs:
        groups.setdefault(key, []).append(module)
    return {key: plainest(modules) for key, modules in groups.items()}


def trace_stats() -> dict[str, int]:
    """``{"hits", "misses", "uncached"}`` counts of :func:`traced_unit` in this process."""
    return dict(_stats)


def clear() -> None:
    """Forget every kept trace (and the counts)."""
    _traced.clear()
    _stats.update(hits=0, misses=0, uncached=0)


def trace_key(module: nn.Module, example_inputs: tuple[Any, ...],
              param_dtype: str | None = None) -> tuple:
    """The trace key of ``module(*example_inputs)`` (see the module's docstring); raises
    ``_Uncacheable`` where a value cannot be compared by value."""
    mods = []
    for path, m in module.named_modules(remove_duplicate=False):
        attrs = vars(m)
        own = tuple((k, _fp(v)) for k, v in sorted(attrs.items())
                    if k not in _SKIPPED_ATTRS and k not in _HOOK_ATTRS)
        code = (m.code,) if isinstance(m, fx.GraphModule) else ()
        mods.append((path, _class_fp(type(m)), code, own, _hooks_fp(attrs)))
    params = tuple((n, _tensor_fp(p)) for n, p in module.named_parameters(remove_duplicate=False))
    bufs = tuple((n, _tensor_fp(b)) for n, b in module.named_buffers(remove_duplicate=False))
    ins = tuple(_tensor_fp(a) if isinstance(a, torch.Tensor) else _fp(a) for a in example_inputs)
    global_hooks = tuple(_fp(list(d.values())) for d in compat.global_module_hooks())
    env = (param_dtype, global_hooks, tuple(tracing.current_settings().items()),
           tuple(_fp(f) for f in tracing.registered()),
           tuple(_fp(f) for f in tracing.registered_call_inputs()), torch.get_default_dtype())
    return tuple(mods), params, bufs, ins, env


def _hooks_fp(attrs: dict[str, Any]) -> tuple:
    """A module's hooks in order, each with its flags (with kwargs, always called)."""
    out = []
    for table, flags in _HOOKS.items():
        hooks = attrs.get(table) or {}
        out.append(tuple((_fp(h), tuple(hid in (attrs.get(f) or {}) for f in flags))
                         for hid, h in hooks.items()))
    return tuple(out)


def _tensor_fp(t: torch.Tensor) -> tuple:
    """A parameter's, buffer's or input's trace-relevant metadata (a DTensor's global shape:
    the unit is traced on a meta copy with global shapes)."""
    stride = tuple(t.stride()) if t.device.type == "meta" and type(t) in (
        torch.Tensor, nn.Parameter) else None  # a meta copy is made contiguous
    return (type(t).__name__, tuple(t.shape), t.dtype, stride, t.requires_grad)


def _class_fp(cls: type) -> tuple:
    """``cls``'s code below ``nn.Module`` (see the module's docstring); an fx.GraphModule's
    per-instance class by its bases (its code is keyed per instance)."""
    if issubclass(cls, fx.GraphModule):
        return ("GraphModule",)
    out = []
    for c in cls.__mro__:
        if c in (nn.Module, object):
            break
        body = tuple((k, _fp(v, 1, code=True)) for k, v in sorted(vars(c).items())
                     if k not in _CLASS_DUNDERS)
        out.append((c.__module__, c.__qualname__, body))
    return tuple(out)


def _fn_fp(fn: types.FunctionType, depth: int, code: bool) -> tuple:
    """A function by its code, defaults, closure values and the module-level functions its
    code names (those by identity)."""
    cells = tuple(_fp(c.cell_contents, depth + 1, code) if _filled(c) else None
                  for c in fn.__closure__ or ())
    g = fn.__globals__  # module-level functions it calls, by identity (replaced: a miss)
    named = tuple((n, g[n]) for n in fn.__code__.co_names
                  if isinstance(g.get(n), types.FunctionType))
    return ("fn", fn.__code__, _fp(fn.__defaults__, depth + 1, code),
            _fp(fn.__kwdefaults__, depth + 1, code), cells, named)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _fp(v: Any, depth: int = 0, code: bool = False) -> Any:
    """A hashable value equal for equal ``v``; raises ``_Uncacheable`` where ``v`` has no
    value equality to compare by, except in a class's code (``code``: e.g. a decorator's
    sentinel in a method's closure), where such a value is compared by identity."""
    if depth > 12:
        raise _Uncacheable("value nested too deep")
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype,
                                   torch.device, enum.Enum, type(Ellipsis))):
        return (type(v), v)
    if isinstance(v, (tuple, list, frozenset, set)):
        items = [_fp(x, depth + 1, code) for x in v]
        return (type(v), tuple(sorted(items, key=repr) if isinstance(v, (set, frozenset))
                               else items))
    if isinstance(v, dict):
        return (type(v), tuple((_fp(k, depth + 1, code), _fp(x, depth + 1, code))
                               for k, x in v.items()))
    if isinstance(v, torch.Tensor):
        if v.device.type != "meta":
            raise _Uncacheable("a tensor attribute holding data")
        return _tensor_fp(v)
    if isinstance(v, type):
        return ("class", v)  # by identity (a module's own class is keyed by its code)
    if isinstance(v, types.FunctionType):
        return _fn_fp(v, depth, code)
    if isinstance(v, (staticmethod, classmethod)):
        return (type(v), _fp(v.__func__, depth + 1, code))
    if isinstance(v, property):
        return ("property", _fp(v.fget, depth + 1, code), _fp(v.fset, depth + 1, code))
    if isinstance(v, (types.BuiltinFunctionType, types.ModuleType)) or type(
            v).__module__.startswith("torch._ops"):
        return ("builtin", v)  # C functions, modules and ops: compared by identity
    if isinstance(v, types.MethodType):  # e.g. a hook: its function and its object's state
        return ("method", _fp(v.__func__, depth + 1, code), _fp(v.__self__, depth + 1, code))
    plain = hasattr(v, "__dict__") and not isinstance(v, nn.Module)
    if plain and (dataclasses.is_dataclass(v) or not code):
        # a config or a plain object (e.g. a hook's owner): its class's code and every
        # attribute's value (never its own __eq__, which may compare tensors)
        return ("object", _class_fp(type(v)),
                tuple((k, _fp(x, depth + 1, code)) for k, x in sorted(vars(v).items())))
    if dataclasses.is_dataclass(v):  # slotted
        return (type(v), tuple((f.name, _fp(getattr(v, f.name), depth + 1, code))
                               for f in dataclasses.fields(v)))
    if type(v).__eq__ is not object.__eq__ and type(v).__hash__ is not None:
        return (type(v), v)  # a value type of its own (e.g. a pybind enum)
    if code:
        return ("object", v)
    raise _Uncacheable(f"a {type(v).__qualname__} attribute")
