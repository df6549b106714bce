"""Docstring counts for a package: share of lines, and docstrings over 15 and 20 lines.

Run ``python scripts/docstring_stats.py [package dir]`` (default ``autopp``); ``--list N``
also names each docstring longer than N lines. Only the standard library is used, so the
figures can be reproduced on any checkout. tests/docs/test_docstrings.py uses ``docstrings()``
to keep every docstring within 15 lines.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def docstrings(pkg: Path):
    """Yield (file, line, name, lines spanned) for each module, class and function docstring
    under ``pkg``. A docstring's length is the source lines its string literal spans."""
    for f in sorted(pkg.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                doc = body[0]
                name = getattr(node, "name", "<module>")
                yield f, doc.lineno, name, doc.end_lineno - doc.lineno + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pkg", nargs="?", default=str(ROOT / "autopp"))
    ap.add_argument("--list", type=int, default=None, metavar="N",
                    help="name every docstring longer than N lines")
    args = ap.parse_args()
    pkg = Path(args.pkg)
    total = sum(len(f.read_text().splitlines()) for f in pkg.rglob("*.py"))
    docs = list(docstrings(pkg))
    doc_lines = sum(n for *_, n in docs)
    print(f"files: {len(list(pkg.rglob('*.py')))}  lines: {total}  docstrings: {len(docs)}")
    print(f"docstring lines: {doc_lines} ({100 * doc_lines / max(total, 1):.1f}% of lines)")
    print(f"docstrings over 20 lines: {sum(n > 20 for *_, n in docs)}")
    print(f"docstrings over 15 lines: {sum(n > 15 for *_, n in docs)}")
    if args.list is not None:
        for f, line, name, n in sorted(docs, key=lambda d: -d[3]):
            if n > args.list:
                print(f"  {n:4d}  {f.relative_to(pkg.parent)}:{line}  {name}")


if __name__ == "__main__":
    main()
