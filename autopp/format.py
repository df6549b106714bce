"""Text forms shared by every report (plan, dry run, pipeline, search): byte counts and
compact lists of module FQNs."""

from __future__ import annotations

import re
from collections.abc import Sequence


def format_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes as text: "512 B", "1.50 KiB", ..., up to GiB (``digits`` after the point)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} GiB"


def compact_modules(fqns: Sequence[str]) -> str:
    """``["tok_embeddings", "layers.0", ..., "layers.7"]`` -> ``"tok_embeddings, layers.0-7"``."""
    out: list[str] = []
    run: list[int] = []
    prefix = None

    def flush():
        if run:
            out.append(f"{prefix}{run[0]}" if len(run) == 1 else f"{prefix}{run[0]}-{run[-1]}")
            run.clear()

    for f in fqns:
        m = re.fullmatch(r"(.*\.)(\d+)", f)
        if m and m.group(1) == prefix and run and int(m.group(2)) == run[-1] + 1:
            run.append(int(m.group(2)))
            continue
        flush()
        if m:
            prefix, run[:] = m.group(1), [int(m.group(2))]
        else:
            prefix = None
            out.append(f)
    flush()
    return ", ".join(out)


def dataclass_json(value: object, indent: int | None = None) -> str:
    """``json.dumps(dataclasses.asdict(value))`` without ``asdict``'s deep copy of every
    nested tuple (slow for a large plan's per-node placements): nested dataclass
    instances become objects of their fields, tuples lists, as ``asdict`` would give them."""
    import dataclasses
    import json

    def fields_of(o: object) -> dict:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

    return json.dumps(value, indent=indent, default=fields_of)
