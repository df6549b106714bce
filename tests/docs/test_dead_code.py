"""No dead code in autopp/: every module-level function and class is named somewhere else.

Beside tests/docs/test_layout.py (which keeps the floors): a module-level definition whose name
appears nowhere in autopp/, tests/, examples/, benchmarks/ or scripts/ except at its own
definition is called by nothing and documented by nothing, so it goes. Decorated
definitions are exempt (a decorator registers them: torch ops' fake and sharding rules,
adapters), as are dunder names. A name used only by a test still counts: the test is its
caller.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCHED = ("autopp", "tests", "examples", "benchmarks", "scripts")


def unused_definitions(root: Path) -> list[str]:
    """``"path: name"`` of each module-level definition under ``root/autopp`` whose name
    appears only once in the searched folders of ``root``."""
    words: Counter = Counter()
    for folder in SEARCHED:
        for path in (root / folder).rglob("*.py"):
            words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text()))
    return [f"{path}: {name}" for path, name in _definitions(root) if words[name] <= 1]


def _definitions(root: Path) -> list[tuple[str, str]]:
    out = []
    for path in sorted((root / "autopp").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                    and not node.decorator_list and not node.name.startswith("__"):
                out.append((str(path.relative_to(root)), node.name))
    return out


def test_every_module_level_definition_is_used():
    unused = unused_definitions(ROOT)
    assert not unused, "defined and never named elsewhere (delete them):\n" + "\n".join(unused)


def test_the_check_finds_an_unused_definition(tmp_path):
    """In a tree of its own: a function nothing calls is found; one a test calls, a
    registered (decorated) one and a dunder are not."""
    (tmp_path / "autopp").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "autopp" / "m.py").write_text(
        "def lonely():\n    pass\n\n\ndef tested():\n    pass\n\n\n"
        "@register\ndef rule():\n    pass\n\n\ndef __getattr__(name):\n    pass\n")
    (tmp_path / "tests" / "test_m.py").write_text("from autopp.m import tested\n")
    assert unused_definitions(tmp_path) == ["autopp/m.py: lonely"]
