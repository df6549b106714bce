"""A stage's planned units, read off how the model's own forward calls its modules.

The stage module's forward is traced with ``torch.fx`` at module boundaries on meta (each
block a leaf), so any decoder whose blocks repeat takes this path and no attribute name is
assumed. Units: ``pre`` (what the forward computes from the stage input before the first
block), one per block call (the previous output first, then the forward's other arguments:
constants, or tensors from buffers, constants and keyword inputs, recomputed per block), and
``post`` (what it computes from the last block's output). The graph is cut where the stage is
cut (:class:`~autopp.stage_split.build.StageCut`). Keyword inputs follow each unit's
activation, whether read or not, and a block runs inside :func:`autopp.tracing.call_inputs`
so what the forward derives from them (transformers' masks) comes from the unit's inputs.

A forward fx cannot trace is exported (:mod:`autopp.tracing.unit_export`); one that does
something else between blocks (a skip around them, arguments from the input's values) is
planned as one flat graph, and :func:`stage_units` logs why."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopp import tracing

logger = logging.getLogger("autopp")

PRE = "pre"
POST = "post"


@dataclass(frozen=True, slots=True)
class Unit:
    """One planned piece of a stage: the ``pre`` part, a block, or the ``post`` part."""

    name: str
    """"pre", "<layers_attr>.<key>" (a block), "post", or "" for a stage planned flat."""
    module: nn.Module
    """The module traced for this unit; called with one tensor, returns one tensor."""
    renames: tuple[tuple[str, str], ...] = ()
    """(prefix in :attr:`module`, prefix in the stage) pairs mapping parameter FQNs; the
    first that matches applies; none: the FQN is the stage's."""

    def stage_fqn(self, fqn: str) -> str:
        """A parameter's FQN in the stage module, from its FQN in :attr:`module`."""
        for old, new in self.renames:
            if fqn.startswith(old):
                return new + fqn[len(old):]
        return fqn


@dataclass(frozen=True, slots=True)
class ExtraRef:
    """Stands in a block's call arguments for output ``index`` of :attr:`BlockCall.extra`."""

    index: int


class BlockCall(nn.Module):
    """Calls ``block(x, *args, **kwargs)`` as the stage's forward does.

    ``args``/``kwargs`` are constants, or :class:`ExtraRef` for the outputs of
    :attr:`extra` (a graph computing tensors from the stage's buffers and constants and the
    keyword inputs only, e.g. a RoPE cache slice), recomputed on each call.
    ``forward(x, *inputs)``: ``inputs`` are the stage's keyword inputs named
    :attr:`input_names` (the extra graph takes them all, in that order); the block runs
    inside ``enter(dict of them)``: :func:`autopp.tracing.call_inputs` of its stage.
    """

    def __init__(self, block: nn.Module, args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None, extra: fx.GraphModule | None = None,
                 input_names: tuple[str, ...] = (), enter: Any = None):
        super().__init__()
        self.block = block
        self.extra = extra
        self.args = args
        self.kwargs = dict(kwargs or {})
        self.input_names = tuple(input_names)
        # a plain function (not a module or partial): copies of this unit share it; the trace
        # cache keys it by the registered call-input contexts (autopp.tracing)
        object.__setattr__(self, "_call_inputs", enter)

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"this block takes the keyword inputs {list(self.input_names)} "
                            f"after its activation, got {len(inputs)} tensors")
        args, kwargs = self.args, self.kwargs
        if self.extra is not None:
            vals = self.extra(*inputs)

            def fill(a: Any) -> Any:
                return vals[a.index] if isinstance(a, ExtraRef) else a

            args = fx.node.map_aggregate(self.args, fill)
            kwargs = fx.node.map_aggregate(self.kwargs, fill)
        if self._call_inputs is None or not inputs:
            return self.block(x, *args, **kwargs)
        with self._call_inputs(dict(zip(self.input_names, inputs))):
            return self.block(x, *args, **kwargs)


def default_extra_args(block: nn.Module) -> tuple[Any, ...]:
    """``None`` for every required positional argument of ``block.forward`` after the first
    (how a block is called when it is planned alone, without its model's forward)."""
    params = list(inspect.signature(block.forward).parameters.values())[1:]
    return tuple(
        None
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


def module_signature(module: nn.Module) -> tuple:
    """Structural key of a module: submodule types, parameter/buffer shapes and dtypes, for
    a traced unit its code and call arguments, and the settings model adapters name
    (:func:`autopp.tracing.trace_settings`: a layer's sliding window)."""
    mods = tuple((n, type(m).__qualname__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())
    bufs = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    code = tuple(_graph_key(m.graph) for _, m in module.named_modules()
                 if isinstance(m, fx.GraphModule))
    call = (repr(module.args), repr(sorted(module.kwargs.items())),
            module.input_names) if isinstance(module, BlockCall) else ()
    settings = tuple((n, s) for n, m in module.named_modules()
                     if (s := tracing.trace_settings(m)))
    return mods, params, bufs, code, call, settings


def _graph_key(graph: fx.Graph) -> tuple:
    """A graph's structure, independent of its node names."""
    index = {n: i for i, n in enumerate(graph.nodes)}

    def ref(a: Any) -> Any:
        return ("node", index[a]) if isinstance(a, fx.Node) else a

    return tuple((n.op, str(n.target), repr(fx.node.map_aggregate(n.args, ref)),
                  repr(sorted(fx.node.map_aggregate(dict(n.kwargs), ref).items())))
                 for n in graph.nodes)


def unit_signature(unit: Unit) -> tuple:
    """Units with equal signatures trace to the same graph and are planned once."""
    return (type(unit.module).__qualname__, module_signature(unit.module))


def layers_path(module: nn.Module) -> str | None:
    """Path of the stage's block container: as recorded by ``build_stage_module``, else
    ``layers`` if the module has one, else found by
    :func:`autopp.stage_split.layout.find_layers`; None when there is none."""
    from autopp.stage_split.build import LAYERS_ATTR
    from autopp.stage_split.layout import find_layers

    path = getattr(module, LAYERS_ATTR, None)
    if path is None:
        if isinstance(getattr(module, "layers", None), (nn.ModuleList, nn.ModuleDict)):
            path = "layers"
        else:
            try:
                path = find_layers(module)
            except ValueError:
                return None
    try:
        container = module.get_submodule(path)
    except AttributeError:
        return None
    return path if isinstance(container, (nn.ModuleList, nn.ModuleDict)) else None


def stage_units(module: nn.Module, example: torch.Tensor | None = None,
                inputs: Mapping[str, torch.Tensor] | None = None,
                param_dtype: str | None = None) -> list[Unit] | None:
    """The units of ``module`` (a stage on meta, or materialised: nothing is run), or None
    when it must be planned as one flat graph (the reason is logged at INFO). ``example``:
    a stage input (its shape and dtype), for forwards only ``torch.export`` can trace;
    ``inputs``: the step's keyword inputs (name -> tensor of their shape and dtype), which
    every unit then takes after its activation, in this order; ``param_dtype``: the plan's
    compute dtype (mixed precision), which an exported forward is traced with."""
    path = layers_path(module)
    if path is None:
        return None
    container = module.get_submodule(path)
    from autopp.stage_split.build import Skipped

    blocks = [(k, b) for k, b in container.named_children()
              if b is not None and not isinstance(b, Skipped)]
    if not blocks:
        return None
    try:
        return _units(module, path, blocks, example, dict(inputs or {}), param_dtype)
    except _Flat as e:
        logger.info("planning %s as one graph: %s", type(module).__name__, e)
        return None


class _Flat(Exception):
    """The stage's forward does not fit the pre / blocks / post pattern (the message says why)."""


_REUSE: list[dict[tuple, tuple[nn.Module, tuple[fx.Graph, dict[str, Any]] | str]]] = []
"""Open :func:`captures_reused` scopes, innermost last: captures by the stage module's
identity and the capture's inputs (the module is kept, so its id is not reused)."""


@contextlib.contextmanager
def captures_reused() -> Iterator[None]:
    """Within: a stage module captured again (the same object, inputs of the same shapes)
    is served from its first capture. For one planning call, which captures each stage for
    every boundary pair and budget it tries and changes no module while it runs."""
    _REUSE.append({})
    try:
        yield
    finally:
        _REUSE.pop()


def _capture(module: nn.Module, path: str, blocks: list[tuple[str, nn.Module]],
             example: torch.Tensor | None, inputs: dict[str, torch.Tensor],
             param_dtype: str | None = None) -> tuple[fx.Graph, dict[str, Any]]:
    """The stage's forward with each block one ``call_module`` node: by ``torch.fx``, else
    by ``torch.export`` on ``example`` and ``inputs``; ``(graph, values of get_attr targets
    the module does not have)``. Callers only read the graph (it may be served again)."""
    def fp(t: torch.Tensor | None) -> tuple | None:
        return None if t is None else (tuple(t.shape), t.dtype)

    memo = _REUSE[-1] if _REUSE else None
    key = (id(module), path, tuple(k for k, _ in blocks), fp(example),
           tuple((k, fp(v)) for k, v in inputs.items()), param_dtype)
    hit = None if memo is None else memo.get(key)
    if hit is None:
        try:
            got: tuple[fx.Graph, dict[str, Any]] | str = _capture_uncached(
                module, path, blocks, example, inputs, param_dtype)
        except _Flat as e:
            got = str(e)
        if memo is not None:
            memo[key] = (module, got)
    else:
        got = hit[1]
    if isinstance(got, str):
        raise _Flat(got)
    return got


def _capture_uncached(module: nn.Module, path: str, blocks: list[tuple[str, nn.Module]],
                      example: torch.Tensor | None, inputs: dict[str, torch.Tensor],
                      param_dtype: str | None = None) -> tuple[fx.Graph, dict[str, Any]]:
    """:func:`_capture`, captured with the blocks standing alone
    (:func:`autopp.tracing.blocks_stand_alone`)."""
    from autopp import tracing

    with tracing.blocks_stand_alone():
        try:
            return _capture_fx(module, {id(b) for _, b in blocks}, tuple(inputs)), {}
        except _Flat as e:
            if example is None:
                raise
            from autopp.tracing.unit_export import ExportFailed, export_at_blocks

            try:
                return export_at_blocks(module, [f"{path}.{k}" for k, _ in blocks], example,
                                        inputs, None if param_dtype is None else
                                        getattr(torch, param_dtype))
            except ExportFailed as e2:
                raise _Flat(f"{e}; {e2}") from e2


def _capture_fx(module: nn.Module, leaves: set[int], names: tuple[str, ...] = ()) -> fx.Graph:
    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return id(m) in leaves or super().is_leaf_module(m, qualname)

    sig = inspect.signature(module.forward)
    params = list(sig.parameters.values())
    concrete = {}
    missing = [n for n in names if n not in sig.parameters]
    if missing:
        raise _Flat(f"its forward takes no keyword input {missing[0]!r}")
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in names:
            continue
        if p.default is p.empty:
            raise _Flat(f"its forward takes a second required argument {p.name!r}")
        concrete[p.name] = p.default
    try:
        return Tracer().trace(module, concrete_args=concrete or None)
    except Exception as e:  # fx cannot trace it (data-dependent control flow, ...)
        raise _Flat(f"torch.fx cannot trace its forward at module boundaries ({e})") from e


def _ancestors(node: fx.Node, stop: fx.Node | None = None) -> set[fx.Node]:
    """The nodes ``node`` reads, directly or not (not through ``stop``, nor ``stop`` itself)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a is not stop and a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _subgraph(graph_nodes: list[fx.Node], inputs: dict[fx.Node, str],
              outputs: Any, root: nn.Module) -> fx.GraphModule:
    """A GraphModule over ``root`` running ``graph_nodes`` (in order), with ``inputs`` (node ->
    placeholder name) as its placeholders and ``outputs`` (a node or nested nodes) returned.
    ``root`` holds what the nodes' targets name (the stage, or :func:`_with_extras`)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, name in inputs.items():
        env[node] = g.placeholder(name)
    for node in graph_nodes:
        if node not in env:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(fx.node.map_arg(outputs, lambda n: env[n]))
    g.lint()
    return fx.GraphModule(root, g)


def _with_extras(module: nn.Module, extras: dict[str, Any]) -> nn.Module:
    """A module with ``module``'s children, parameters and buffers, and ``extras`` (modules
    as children, tensors as buffers): the root an exported graph's targets resolve in."""
    if not extras:
        return module
    root = nn.Module()
    root._modules = {**module._modules, **{k: v for k, v in extras.items()
                                           if isinstance(v, nn.Module)}}
    root._parameters = module._parameters
    root._buffers = {**module._buffers, **{k: v for k, v in extras.items()
                                           if isinstance(v, torch.Tensor)}}
    for k, v in extras.items():
        if not isinstance(v, nn.Module | torch.Tensor):
            object.__setattr__(root, k, v)
    return root


def _input_placeholders(placeholders: list[fx.Node], names: list[str]) -> dict[fx.Node, str]:
    """The keyword inputs' placeholders (by name; the captures name them after the forward's
    parameters), placeholder -> name, in the order of ``names``."""
    by_name = {str(n.target): n for n in placeholders[1:]}
    missing = [k for k in names if k not in by_name]
    if missing:
        raise _Flat(f"its captured forward has no input {missing[0]!r} "
                    f"(inputs: {sorted(by_name)})")
    return {by_name[k]: k for k in names}


def _units(module: nn.Module, path: str, blocks: list[tuple[str, nn.Module]],
           example: torch.Tensor | None = None,
           inputs: dict[str, torch.Tensor] | None = None,
           param_dtype: str | None = None) -> list[Unit]:
    from autopp import tracing
    from autopp.stage_split.build import CUT_ATTR

    inputs = inputs or {}
    graph, extras = _capture(module, path, blocks, example, inputs, param_dtype)
    root = _with_extras(module, extras)
    cut = getattr(module, CUT_ATTR, None)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    x = placeholders[0]
    kw = _input_placeholders(placeholders, list(inputs))
    names = tuple(inputs)

    def enter(values: dict[str, torch.Tensor]) -> Any:
        return tracing.call_inputs(module, values)
    calls = [n for n in nodes if n.op == "call_module"
             and n.target.startswith(path + ".") and n.target.count(".") == path.count(".") + 1]
    want = [f"{path}.{k}" for k, _ in blocks]
    if [n.target for n in calls] != want:
        raise _Flat(f"its forward calls the blocks as {[n.target for n in calls]}, not once "
                    f"each in order ({want})")
    pos = {n: i for i, n in enumerate(nodes)}
    side = {n for n in nodes if not ({x, *calls} & (_ancestors(n) | {n}))}
    # side values: computed from buffers, constants and the keyword inputs only
    for prev, call in zip(calls, calls[1:]):
        if not call.args or call.args[0] is not prev or len(prev.users) != 1:
            raise _Flat(f"{call.target}'s first argument is not {prev.target}'s output alone")
    units: list[Unit] = []
    first = calls[0]
    if not first.args or not isinstance(first.args[0], fx.Node):
        raise _Flat(f"{first.target} is not called with a tensor first")
    h0 = first.args[0]
    if cut is not None and cut.receives and cut.first == first.target:
        h0 = x  # a later stage: its input, whatever the forward computed before the block
    if h0 is not x:
        pre_nodes = sorted(_ancestors(h0) | {h0}, key=pos.get)
        if x not in pre_nodes:
            raise _Flat(f"{first.target}'s input does not depend on the stage input")
        units.append(Unit(PRE, _subgraph(pre_nodes, {x: "x", **kw}, h0, root)))
    extras_cache: dict[tuple, tuple] = {}
    for (key, block), call in zip(blocks, calls):
        args, kwargs, extra = _block_args(call, side, pos, root, extras_cache, kw)
        units.append(Unit(f"{path}.{key}", BlockCall(block, args, kwargs, extra, names,
                                                     enter if names else None),
                          (("block.", f"{path}.{key}."), ("extra.", ""))))
    (out_node,) = [n for n in nodes if n.op == "output"]
    last = calls[-1]
    out = out_node.args[0]
    if cut is not None and cut.sends and cut.last == last.target:
        out = last  # an earlier stage: its last block's output, whatever comes after
    if not isinstance(out, fx.Node):
        raise _Flat("its forward does not return one tensor")
    if out is not last:
        post = _ancestors(out, stop=last) | {out}
        early = [n for n in post if (n.op == "placeholder" and n not in kw)
                 or n in calls[:-1]]
        if early:
            raise _Flat(f"the part after the blocks reads {early[0].name}, from before them")
        for n in post - side:
            bad = [a for a in n.all_input_nodes if a is not last and a not in post]
            if bad:
                raise _Flat(f"the part after the blocks reads {bad[0].name}, computed before them")
        post_nodes = sorted(post, key=pos.get)
        units.append(Unit(POST, _subgraph(post_nodes, {last: "h", **kw}, out, root)))
    owner: dict[int, str] = {}
    for unit in units:
        for _, p in unit.module.named_parameters():
            if owner.setdefault(id(p), unit.name) != unit.name:
                raise _Flat(f"a parameter is tied between {owner[id(p)]} and {unit.name}")
    return units


def _block_args(call: fx.Node, side: set[fx.Node], pos: dict, root: nn.Module,
                cache: dict, kw: dict[fx.Node, str] | None = None
                ) -> tuple[tuple, dict, fx.GraphModule | None]:
    """A block call's arguments after the first: constants as they are, side tensors (from
    buffers, constants and the keyword inputs ``kw`` only) as named outputs of one small
    graph ``extra``, which takes every keyword input in order."""
    refs: list[fx.Node] = []

    def ref(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a not in side:
            raise _Flat(f"{call.target}'s argument {a.name} is computed from the stage input; "
                        "only constants, values of buffers and keyword inputs can be passed "
                        "to blocks")
        if a not in refs:
            refs.append(a)
        return ExtraRef(refs.index(a))

    args = fx.node.map_aggregate(tuple(call.args[1:]), ref)
    kwargs = fx.node.map_aggregate(dict(call.kwargs), ref)
    if not refs:
        return args, kwargs, None
    key = tuple(refs)
    if key not in cache:
        nodes = sorted(set().union(*(_ancestors(r) | {r} for r in refs)), key=pos.get)
        cache[key] = (_subgraph(nodes, dict(kw or {}), tuple(refs), root),)
    return args, kwargs, cache[key][0]
