"""The ```python examples of README.md and docs/usage.md run, so they cannot drift from the API.

What: every python block is run as a script in a fresh process (under torchrun where it
needs ranks). Why: the examples are the API most users copy. Invariant: a block runs as
written except for what the HTML comment just above it says, in the markdown source for
anyone to read: ``<!-- docs-test: ranks=2; "old" -> "new"; continues -->`` runs it on 2
ranks, with each ``"old" -> "new"`` size substitution applied (each must apply: a
substitution that no longer matches fails the test), ``continues`` after the block before
it (a chain runs once, at its last block, in its last block's ranks). Blocks run in small
sizes on CPU.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.launch import run_command

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/usage.md")
_BLOCK = re.compile(r"(?:<!--\s*docs-test:(?P<directive>.*?)-->\s*\n)?```python\n(?P<code>.*?)```",
                    re.S)
_SUB = re.compile(r'"((?:[^"\\]|\\.)*)"\s*->\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, kw_only=True)
class Example:
    """One runnable example: a block (with the blocks it continues), as the test runs it."""

    name: str
    code: str
    ranks: int = 1


def examples(doc: str) -> list[Example]:
    """The examples of ``doc`` (a path under the repository), substitutions applied."""
    text = (ROOT / doc).read_text()
    out: list[Example] = []
    chain = ""
    for m in _BLOCK.finditer(text):
        directive, code = m.group("directive") or "", m.group("code")
        line = text.count("\n", 0, m.start("code"))
        for old, new in _SUB.findall(directive):
            old, new = old.replace('\\"', '"'), new.replace('\\"', '"')
            if old not in code:
                raise AssertionError(f"{doc}:{line}: the docs-test substitution {old!r} no "
                                     f"longer matches its block: update the comment above it")
            code = code.replace(old, new)
        ranks = re.search(r"ranks\s*=\s*(\d+)", directive)
        name = f"{doc}:{line}"
        if "continues" in directive and out:  # one run for the chain, at its last block
            code, name = chain + code, f"{out.pop().name.split('-')[0]}-{line}"
        chain = code
        out.append(Example(name=name, code=code, ranks=int(ranks.group(1)) if ranks else 1))
    return out


ALL = [e for doc in DOCS for e in examples(doc)]


def test_every_doc_has_examples():
    assert {e.name.split(":")[0] for e in ALL} == set(DOCS)


# an example on several ranks is a launch: one at a time, with the other launches
@pytest.mark.parametrize("example", [
    pytest.param(e, id=e.name, marks=[pytest.mark.multiprocess] if e.ranks > 1 else [])
    for e in ALL])
def test_example_runs(example: Example, tmp_path):
    """The example runs to its end (in ``tmp_path``: what it writes stays there)."""
    script = tmp_path / "example.py"
    script.write_text(example.code)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script)]
    if example.ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(example.ranks), str(script)]
    run_command(cmd, timeout=600, cwd=tmp_path, env=env)
