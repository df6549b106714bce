"""Every docstring in autopp/ is at most 15 lines: it says what, why and the invariant;
measurements and history belong in benchmarks/README.md and the commit messages.

Counted by ``scripts/docstring_stats.py`` (``python scripts/docstring_stats.py --list 15``
names the longest)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 15


def _stats():
    spec = importlib.util.spec_from_file_location("docstring_stats",
                                                  ROOT / "scripts" / "docstring_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_docstring_in_autopp_exceeds_15_lines():
    long = [(f.relative_to(ROOT).as_posix(), line, name, n)
            for f, line, name, n in _stats().docstrings(ROOT / "autopp") if n > MAX_LINES]
    over = [f"{f}:{line} {name} ({n} lines)" for f, line, name, n in long]
    assert not over, "docstrings over 15 lines (what, why, the invariant; figures and "\
        "history go to benchmarks/README.md and commits):\n" + "\n".join(over)


def test_the_counter_counts_the_lines_of_each_docstring(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text('"""One."""\n\n\ndef f():\n    """Two\n\n    lines."""\n')
    found = {(name, n) for _, _, name, n in _stats().docstrings(pkg)}
    assert found == {("<module>", 1), ("f", 3)}
