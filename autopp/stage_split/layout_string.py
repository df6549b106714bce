"""A compact string for a stage split, in the spirit of Megatron's pipeline layout flag.

Grammar (whitespace and commas ignored except inside a number)::

    layout := item+
    item   := atom ( "*" COUNT )?        COUNT: decimal integer >= 1
    atom   := "E" | "t" | "L" | "|" | "(" item* ")"

``|`` ends a stage; ``E`` is all pre modules, ``L`` all post modules, ``t`` one layer (handed
out in model order); ``X*N`` repeats an atom or group. ``"Ett|tt|ttL"``, ``"Et*2|t*2|t*2L"``
and ``"E(tt|)*2ttL"`` are the same 3-stage split of a 6-layer model. The string must use each
layer once, ``E`` and ``L`` once where the model has them, and give a valid split
(:mod:`autopp.stage_split.validate`). Errors give 0-based positions in the string."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from autopp.stage_split.layout import ModelLayout
from autopp.stage_split.validate import validate_split

__all__ = ["format_layout", "parse_layout"]

_SYMBOLS = "EtL|"
_SKIP = " \t\r\n,"


@dataclass(frozen=True, slots=True)
class _Node:
    """One atom of a parsed layout with its repetition count."""

    symbol: str | None
    """``"E"``, ``"t"``, ``"L"`` or ``"|"``; None for a parenthesised group."""
    children: tuple[_Node, ...]
    """The group's items (empty for a symbol)."""
    repeat: int
    """How many times the atom is repeated (1 without ``*N``)."""

    def count(self, symbol: str) -> int:
        """How many times ``symbol`` occurs once fully expanded."""
        if self.symbol is not None:
            inner = 1 if self.symbol == symbol else 0
        else:
            inner = sum(child.count(symbol) for child in self.children)
        return inner * self.repeat

    def size(self) -> int:
        """Number of symbols once fully expanded."""
        return sum(self.count(symbol) for symbol in _SYMBOLS)

    def expand(self) -> Iterator[str]:
        """The symbols of this atom, repetitions written out."""
        if self.symbol is None and self.size() == 0:
            return  # e.g. "()*1000000000": nothing to write out, however often
        for _ in range(self.repeat):
            if self.symbol is not None:
                yield self.symbol
            else:
                for child in self.children:
                    yield from child.expand()


class _Parser:
    """Recursive-descent parser for the grammar in the module docstring."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.pos = 0

    def error(self, what: str, pos: int | None = None) -> ValueError:
        at = self.pos if pos is None else pos
        return ValueError(f"malformed layout {self.spec!r}: {what} at position {at}")

    def peek(self) -> str:
        """The next significant character ('' at the end); skips whitespace and commas."""
        while self.pos < len(self.spec) and self.spec[self.pos] in _SKIP:
            self.pos += 1
        return self.spec[self.pos] if self.pos < len(self.spec) else ""

    def parse(self) -> tuple[_Node, ...]:
        items = self.items()
        if self.peek() == ")":
            raise self.error("unmatched ')'")
        return items

    def items(self) -> tuple[_Node, ...]:
        items = []
        while self.peek() not in ("", ")"):
            items.append(self.item())
        return tuple(items)

    def item(self) -> _Node:
        char, start = self.peek(), self.pos
        if char in _SYMBOLS:
            self.pos += 1
            node = _Node(char, (), 1)
        elif char == "(":
            self.pos += 1
            children = self.items()
            if self.peek() != ")":
                raise self.error("'(' is never closed", start)
            self.pos += 1
            node = _Node(None, children, 1)
        elif char == "*":
            raise self.error("'*' has nothing to repeat")
        else:
            raise self.error(f"unexpected {char!r} (expected E, t, L, | or '(')")
        if self.peek() == "*":
            self.pos += 1
            node = _Node(node.symbol, node.children, self.count())
        return node

    def count(self) -> int:
        self.peek()
        start = self.pos
        while self.pos < len(self.spec) and self.spec[self.pos].isdigit():
            self.pos += 1
        if self.pos == start or int(self.spec[start : self.pos]) < 1:
            raise self.error("expected a count >= 1 after '*'", start)
        return int(self.spec[start : self.pos])


def parse_layout(spec: str, layout: ModelLayout) -> list[list[str]]:
    """Turn a layout string such as ``"Ett|tt|ttL"`` into a validated split.

    Args:
        spec: the layout string (grammar in this module's docstring).
        layout: the model's layout, from :func:`autopp.stage_split.inspect_model`.

    Returns:
        For each stage, the module FQNs it holds, in model order.

    Raises:
        ValueError: malformed string (naming the position), a ``t`` count that differs from the
            model's layer count (naming both), ``E``/``L`` missing, repeated or without modules
            to stand for, or an invalid split (empty stage, out of order).
    """
    if not isinstance(spec, str):
        raise TypeError(f"a layout string is a str, got {type(spec).__name__}")
    root = _Node(None, _Parser(spec).parse(), 1)
    if root.size() == 0:
        raise ValueError(f"layout string {spec!r} is empty")
    n_t = root.count("t")
    if n_t != layout.n_layers:
        raise ValueError(
            f"layout {spec!r} has {n_t} layers ('t') but the model has {layout.n_layers} layers"
        )
    for symbol, modules, side in (("E", layout.pre, "before"), ("L", layout.post, "after")):
        n = root.count(symbol)
        if n > 1:
            raise ValueError(
                f"layout {spec!r} has {n} {symbol!r}; {symbol!r} stands for all modules {side} "
                f"{layout.layers_attr!r}, which go to one stage"
            )
        if n == 1 and not modules:
            raise ValueError(
                f"layout {spec!r} has {symbol!r} but the model has no modules {side} "
                f"{layout.layers_attr!r}"
            )
        if n == 0 and modules:
            raise ValueError(
                f"layout {spec!r} has no {symbol!r}, but the model has modules {side} "
                f"{layout.layers_attr!r} ({', '.join(modules)}) that {symbol!r} must place"
            )
    n_stages = root.count("|") + 1
    n_units = n_t + root.count("E") + root.count("L")
    if n_stages > n_units:
        raise ValueError(
            f"layout {spec!r} has {n_stages} stages but only {n_units} of E, t and L to fill "
            "them; some stage would be empty"
        )
    layer_fqns = iter(layout.layer_fqns)
    stages: list[list[str]] = [[]]
    for symbol in root.expand():
        if symbol == "|":
            stages.append([])
        elif symbol == "E":
            stages[-1].extend(layout.pre)
        elif symbol == "L":
            stages[-1].extend(layout.post)
        else:
            stages[-1].append(next(layer_fqns))
    return validate_split(stages, layout)


def format_layout(fqns_per_stage: Sequence[Sequence[str]], layout: ModelLayout) -> str:
    """Write a split as a layout string, e.g. ``"Ett|tt|ttL"``; runs of 4+ layers as ``t*N``.

    ``parse_layout(format_layout(split, layout), layout)`` gives ``split`` back (normalised).

    Raises:
        ValueError: the split is invalid, or it splits the pre (or post) modules over more
            than one stage, which ``E``/``L`` cannot express.
    """
    stages = validate_split(fqns_per_stage, layout)
    pre, post = set(layout.pre), set(layout.post)
    parts = []
    for stage in stages:
        n_pre = sum(fqn in pre for fqn in stage)
        n_post = sum(fqn in post for fqn in stage)
        for n, group, symbol in ((n_pre, layout.pre, "E"), (n_post, layout.post, "L")):
            if 0 < n < len(group):
                raise ValueError(
                    f"the split puts only some of {', '.join(group)} in one stage; "
                    f"a layout string's {symbol!r} cannot express that"
                )
        n_layers = len(stage) - n_pre - n_post
        layers = f"t*{n_layers}" if n_layers >= 4 else "t" * n_layers
        parts.append(("E" if n_pre else "") + layers + ("L" if n_post else ""))
    return "|".join(parts)
