"""The package layout: no import cycle between files, private torch/torchtitan names only in
``autopp/_compat/``, and every import goes down the data path's floors (docs/design.md,
"Layout").

Imports are read from the source (module level and inside functions; not those under
``if TYPE_CHECKING:``), so an import hidden in a function counts as much as one at the top.
The scanner itself is checked on a small package with a cycle, a private import and an
upward import made on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Floors from the bottom; a module may import its own floor and those below it. The key is
#: the first path part under ``autopp/`` (a folder, or a top-level module without ``.py``);
#: ``name.*`` keys the modules inside folder ``name`` apart from its ``__init__.py``, which
#: then has the floor of ``name`` (``tracing/__init__.py`` holds registries every floor
#: enters; the modules beside it trace, on ops and the stage split).
FLOORS: list[tuple[str, ...]] = [
    ("_compat",),
    ("format", "tracing", "disk_cache", "mesh", "init", "loss", "checkpoint", "checkpoint_hf",
     "extras", "models"),
    ("profiles", "graph", "schedules", "stage_split", "tied"),
    ("ops",),
    ("tracing.*",),
    ("sharding",),
    ("adapters",),
    ("lower",),
    ("plan",),
    ("backends",),
    ("pipeline",),
    ("api",),
    ("estimate",),
    ("dry_run",),
    ("layout_search",),
    ("integrations",),
    ("cli", "__main__"),
    ("__init__",),
]
FLOOR_OF = {name: i for i, names in enumerate(FLOORS) for name in names}
PRIVATE_OWNERS = ("torch", "torchtitan")


def _modname(pkg_root: Path, f: Path) -> str:
    parts = list(f.relative_to(pkg_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(cur: str, is_pkg: bool, level: int, mod: str | None) -> str:
    if level == 0:
        return mod or ""
    base = cur.split(".") if is_pkg else cur.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([mod] if mod else []))


def scan(pkg_root: Path):
    """(edges between the package's modules, private imports outside _compat/) of the
    package at ``pkg_root``; edges as {module: {(imported module, line)}}."""
    pkg = pkg_root.name
    files = {_modname(pkg_root, f): f for f in pkg_root.rglob("*.py")}
    edges: dict[str, set[tuple[str, int]]] = {m: set() for m in files}
    leaks: list[str] = []
    for m, f in files.items():
        tree = ast.parse(f.read_text())
        skipped = {id(sub) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for sub in ast.walk(node)}
        in_compat = "_compat" in f.relative_to(pkg_root).parts
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m, f.name == "__init__.py", node.level, node.module)
                targets = [(base, a.name) for a in node.names]
            else:
                continue
            for base, name in targets:
                top = base.split(".")[0]
                if top in PRIVATE_OWNERS and not in_compat and (
                        any(p.startswith("_") for p in base.split("."))
                        or (name or "").startswith("_")):
                    leaks.append(f"{f.relative_to(pkg_root.parent)}:{node.lineno} "
                                 f"{base}{'.' + name if name else ''}")
                if top != pkg:
                    continue
                full = f"{base}.{name}" if name else base
                dst = full if full in files else base if base in files else None
                if dst and dst != m:
                    edges[m].add((dst, node.lineno))
    return edges, leaks


def cycles(edges: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: {d for d, _ in e} for m, e in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _floor(module: str) -> int | None:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if len(parts) > 2 and f"{key}.*" in FLOOR_OF:
        key = f"{key}.*"
    return FLOOR_OF.get(key)


def upward_imports(edges: dict[str, set[tuple[str, int]]]) -> list[str]:
    """Imports from a lower floor to a higher one, and modules on no floor."""
    out = []
    for m, targets in sorted(edges.items()):
        fm = _floor(m)
        if fm is None:
            out.append(f"{m} is on no floor: add it to FLOORS (and to docs/design.md)")
            continue
        for dst, line in sorted(targets):
            fd = _floor(dst)
            if fd is not None and fd > fm:
                out.append(f"{m}:{line} imports {dst}, which is on a higher floor "
                           f"({fd}: {', '.join(FLOORS[fd])}) than it ({fm}: "
                           f"{', '.join(FLOORS[fm])})")
    return out


def test_no_cycles_no_private_imports_no_upward_imports():
    edges, leaks = scan(ROOT / "autopp")
    assert cycles(edges) == []
    assert leaks == []
    assert upward_imports(edges) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "autopp"


def test_scanner_finds_a_cycle_a_private_import_and_an_upward_import(tmp_path):
    pkg = _write(tmp_path, {
        "autopp/__init__.py": "",
        "autopp/mesh.py": "def f():\n    from autopp.plan import make\n",  # upward, in a function
        "autopp/plan/__init__.py": "",
        "autopp/plan/make.py": "from autopp.plan import value\n",
        "autopp/plan/value.py": "from typing import TYPE_CHECKING\n"
                                "from autopp.plan.make import x\n"  # cycle make <-> value
                                "if TYPE_CHECKING:\n    from autopp.api import y\n",  # ignored
        "autopp/sharding/trace.py": "from torch._subclasses.fake_tensor import FakeTensorMode\n"
                                    "from torch.distributed.tensor import _utils\n",
        "autopp/_compat/ok.py": "from torch._subclasses import fake_tensor\n",
        "autopp/stray.py": "",
    })
    edges, leaks = scan(pkg)
    assert cycles(edges) == [["autopp.plan.make", "autopp.plan.value"]]
    assert leaks == ["autopp/sharding/trace.py:1 torch._subclasses.fake_tensor.FakeTensorMode",
                     "autopp/sharding/trace.py:2 torch.distributed.tensor._utils"]
    up = upward_imports(edges)
    assert any(u.startswith("autopp.mesh:2 imports autopp.plan.make, which is on a higher "
                            "floor (8: plan)") for u in up), up
    assert any(u.startswith("autopp.stray is on no floor") for u in up)
    assert not any("autopp.api" in u for u in up)


@pytest.mark.parametrize("name", ["pipeline_autoparallel", "Pipeline", "PipelinePlan",
                                  "plan_pipeline", "search", "SearchReport",
                                  "build_world_mesh", "init_module_", "cross_entropy"])
def test_public_names_keep_working(name):
    import autopp

    assert getattr(autopp, name) is not None


def test_public_modules_keep_working():
    from autopp.backends import CompileOptions, Planner, PlannerOptions  # noqa: F401
    from autopp.dry_run import DryRunReport, dry_run  # noqa: F401
    from autopp.graph import GraphStage, split_joint_graph  # noqa: F401
    from autopp.schedules import schedule_info  # noqa: F401
    from autopp.sharding import StagePlan, plan_stage  # noqa: F401
    from autopp.stage_split import resolve_split  # noqa: F401
