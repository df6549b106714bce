"""Every ``autopp/...`` path the docs name exists, so the prose cannot keep pointing at files
that moved or were deleted (docs/*.md, README.md, benchmarks/README.md)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
PATH = re.compile(r"(?<![\w./-])autopp/[\w./*-]*[\w*/]")


def named_paths(text: str) -> set[str]:
    """The ``autopp/...`` paths in ``text``: a file, a folder (with or without its trailing
    slash) or a glob such as ``autopp/_compat/*``."""
    return {m.group(0).rstrip("/") for m in PATH.finditer(text)}


def test_named_paths_parses_what_the_docs_write():
    text = "see `autopp/plan/make.py`, autopp/graph/ and autopp/_compat/* (autopp/x.py:12)."
    assert named_paths(text) == {"autopp/plan/make.py", "autopp/graph", "autopp/_compat/*",
                                 "autopp/x.py"}


@pytest.mark.parametrize("doc", [d for d in DOCS if d.exists()], ids=lambda d: str(d.relative_to(ROOT)))
def test_every_autopp_path_a_doc_names_exists(doc: Path):
    missing = sorted(p for p in named_paths(doc.read_text())
                     if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_file_design_md_names_exists():
    """docs/design.md names files relative to their floor (`sharding/budget.py`, `budget.py`):
    each backquoted file name must be the end of a path in the repository."""
    files = {os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, fs in os.walk(ROOT)
             if not dirs.__setitem__(slice(None), [x for x in dirs if not x.startswith(".")])
             for f in fs}
    names = re.findall(r"`([\w./-]+\.(?:py|sh|md))`", (ROOT / "docs" / "design.md").read_text())
    missing = sorted({n for n in names if not any(f == n or f.endswith("/" + n) for f in files)})
    assert not missing, f"docs/design.md names files that do not exist: {missing}"
