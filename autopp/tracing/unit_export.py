"""A stage's forward at module boundaries through ``torch.export``, for forwards that
``torch.fx``'s symbolic tracer cannot follow (Hugging Face transformers' decorated forwards,
shapes read off the input, mask helpers).

:mod:`autopp.tracing.units` cuts a stage into ``pre`` / blocks / ``post`` from one graph in
which each block is a ``call_module`` node called as the forward calls it. ``torch.fx``
traces that graph symbolically; when it cannot, this module gets the same graph from
``torch.export`` (non-strict, on meta, on the given example input's shape, so values
computed from shapes such as a RoPE table are constants of the graph; its factories create on
meta, as every unit is traced on meta and lowered graphs create on the mesh's device): the blocks' call signatures are
preserved (``preserve_module_call_signature``), the program is unflattened into its module
tree, and every module that is not a block is inlined back into one graph. Parameters,
buffers and modules keep the stage's own FQNs; what the export created (constants, the
subgraphs of ``torch.no_grad`` / ``autocast`` regions) is returned by name beside the graph.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn

from autopp import tracing
from autopp._compat import graph as pytree  # torch's pytree (private)


# Exported graphs carry torch's TreeSpec values; copying them (graphs are deep-copied on the
# way to the planner) trips a deprecation inside torch's pytree that no caller can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*",
                        category=FutureWarning)


class ExportFailed(Exception):
    """The forward cannot be exported at module boundaries (the message says why)."""


def export_at_blocks(module: nn.Module, block_fqns: list[str], example: torch.Tensor,
                     kwargs: Mapping[str, torch.Tensor] | None = None,
                     param_dtype: torch.dtype | None = None,
                     ) -> tuple[fx.Graph, dict[str, Any]]:
    """``(graph, extras)``: ``module``'s forward on ``example``'s shape (and keyword inputs
    ``kwargs``, by name, shape and dtype) with each block in ``block_fqns`` one
    ``call_module`` node (its arguments as the forward passes them) and everything else
    inlined; ``extras`` maps the graph's ``get_attr`` targets that are not attributes of
    ``module`` to their values. The graph's placeholders are the example input, then the
    keyword inputs in the order of ``kwargs``. ``param_dtype``: the dtype the stage computes
    its floating-point parameters in (mixed precision), so dtypes the forward reads off its
    values (a RoPE table's ``.to(x.dtype)``) are the ones it runs with."""
    x = torch.empty(example.shape, dtype=example.dtype, device="meta")
    kw = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
          for k, v in (kwargs or {}).items()}
    try:
        with tracing.on_meta(), _on_meta(module, param_dtype), _binding(module, kw), \
                warnings.catch_warnings():
            # torch's own notes while unflattening (its TreeSpec constants, a pytree
            # deprecation): nothing a user can act on
            warnings.filterwarnings("ignore", message=".*get_attr Node with no underlying")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            program = torch.export.export(module, (x,), kw, strict=False,
                                          preserve_module_call_signature=tuple(block_fqns))
            tree = torch.export.unflatten(program)
    except Exception as e:  # noqa: BLE001 - any export failure means "plan it flat"
        raise ExportFailed(f"torch.export cannot trace it ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from e
    inliner = _Inliner(module, set(block_fqns))
    out = inliner.run(tree, "", None)
    if isinstance(out, list | tuple) and len(out) == 1:  # the program's flat outputs
        out = out[0]
    inliner.graph.output(out)
    for node in reversed(list(inliner.graph.nodes)):  # what the cut left unused
        if node.op in ("call_function", "call_method", "get_attr") and not node.users and \
                not node.is_impure():
            inliner.graph.erase_node(node)
    inliner.graph.lint()
    return inliner.graph, inliner.extras


@contextlib.contextmanager
def _binding(module: nn.Module, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """``module`` whose forward binds the keyword inputs ``kwargs`` even where it does not
    name them: ``torch.export`` binds the call to the forward's signature before the
    forward pre-hooks run, and the stage cut's hook takes the model's own inputs
    (``autopp_input_0``, ...) out of the call (:class:`~autopp.stage_split.build.StageCut`)."""
    params = inspect.signature(module.forward).parameters
    if all(k in params for k in kwargs) or any(p.kind == p.VAR_KEYWORD
                                              for p in params.values()):
        yield
        return
    forward = module.forward

    def any_keywords(*args: Any, **kw: Any) -> Any:
        return forward(*args, **kw)

    module.__dict__["forward"] = any_keywords
    try:
        yield
    finally:
        del module.__dict__["forward"]


@contextlib.contextmanager
def _on_meta(module: nn.Module, param_dtype: torch.dtype | None = None) -> Iterator[None]:
    """``module`` with plain meta tensors of the same global shapes in place of its
    parameters and buffers (materialised or DTensors; floating-point parameters in
    ``param_dtype`` when given), restored on exit: the graph's structure is all the export
    is for."""
    swapped: list[tuple[dict, str, Any]] = []
    twins: dict[int, torch.Tensor] = {}

    def twin(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in twins:
            cast = param and param_dtype is not None and t.is_floating_point()
            meta = torch.empty(t.shape, dtype=param_dtype if cast else t.dtype, device="meta")
            twins[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if param else meta
        return twins[id(t)]

    try:
        for mod in module.modules():
            for table, param in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in list(table.items()):
                    if t is not None and (param and param_dtype is not None or not (
                            t.is_meta and type(t) in (torch.Tensor, nn.Parameter))):
                        swapped.append((table, name, t))
                        table[name] = twin(t, param)
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


class _Inliner:
    """Interprets an unflattened program's graphs symbolically into one flat graph."""

    def __init__(self, root: nn.Module, blocks: set[str]):
        self.root, self.blocks = root, blocks
        self.graph = fx.Graph()
        self.extras: dict[str, Any] = {}

    def run(self, mod: nn.Module, prefix: str, inputs: list[Any] | None) -> Any:
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in mod.graph.nodes if n.op == "placeholder"]
        if inputs is None:
            inputs = [self.graph.placeholder(n.name) for n in placeholders]
        if len(inputs) != len(placeholders):
            raise ExportFailed(f"{prefix or 'the stage'} is called with {len(inputs)} inputs, "
                               f"its graph takes {len(placeholders)}")

        def val(a: Any) -> Any:
            return fx.node.map_aggregate(a, lambda n: env[n] if isinstance(n, fx.Node) else n)

        for n in mod.graph.nodes:
            if n.op == "placeholder":
                env[n] = inputs[placeholders.index(n)]
            elif n.op == "get_attr":
                env[n] = self._attr(mod, prefix, n.target)
            elif n.op == "call_module":
                full = prefix + n.target
                args, kwargs = val(n.args), val(n.kwargs)
                if full in self.blocks:
                    env[n] = self.graph.call_module(full, tuple(args), dict(kwargs))
                else:
                    env[n] = self.run(mod.get_submodule(n.target), full + ".",
                                      pytree.tree_leaves((args, kwargs)))
            elif n.op == "call_function" and n.target is pytree.tree_unflatten:
                leaves, spec = val(n.args)
                env[n] = pytree.tree_unflatten(list(leaves), spec)
            elif n.op == "call_function" and getattr(n.target, "__name__", "") == \
                    "tree_flatten_spec":
                value, spec = val(n.args)
                if spec.is_leaf():
                    env[n] = [value]
                else:
                    env[n] = self._flatten(value, spec)
            elif n.op == "call_function" and n.target is operator.getitem and \
                    not isinstance(val(n.args[0]), fx.Node):
                obj, key = val(n.args)
                env[n] = obj[key]
            elif n.op == "output":
                return val(n.args[0])
            else:
                env[n] = self.graph.create_node(n.op, n.target, tuple(val(n.args)),
                                                dict(val(n.kwargs)), n.name)
        raise ExportFailed("an unflattened graph has no output")

    def _flatten(self, value: Any, spec: Any) -> list[Any]:
        """A block's output flattened to ``spec``'s leaves (getitem nodes on its node)."""
        if not isinstance(value, fx.Node):
            return pytree.tree_leaves(value)
        if spec.type is not tuple or any(not c.is_leaf() for c in spec.children()):
            raise ExportFailed(f"a block returns {spec}, not a tensor or a tuple of tensors")
        return [self.graph.call_function(operator.getitem, (value, i))
                for i in range(spec.num_children)]

    def _attr(self, mod: nn.Module, prefix: str, target: str) -> Any:
        """A get_attr: a TreeSpec as its value; the stage's own parameter, buffer or module
        by its stage FQN; anything the export made (a constant, a region's subgraph) as
        an extra."""
        value = _resolve(mod, target)
        if isinstance(value, pytree.TreeSpec):
            return value
        if _resolve(self.root, prefix + target) is not None:
            return self.graph.get_attr(prefix + target)
        name = f"_autopp_export_{len(self.extras)}"
        self.extras[name] = value
        return self.graph.get_attr(name)


def _resolve(mod: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` under ``mod``, or None."""
    for part in path.split("."):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod
