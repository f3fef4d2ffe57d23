"""No import cycles among the kvgate packages, counting every import statement.

Imports inside functions and under `if TYPE_CHECKING:` count too: a cycle hidden behind either
is still two modules that each need the other. The graph is read from the source (ast), so a
cycle fails here even on a path no test happens to import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

PACKAGES = ("cachekey", "kvgate_cli", "gateway", "worker", "harness", "bench")


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imported(node: ast.AST, module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The modules one import statement names: `from pkg import sub` names pkg.sub if it is one."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _base(node, module, path.name == "__init__.py")
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return []


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports, anywhere in its source."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {n for node in ast.walk(tree) for n in _imported(node, module, path, modules)}
        graph[module] = {n for n in names if n in modules and n != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_hidden_imports(tmp_path: Path) -> None:
    """A cycle made only of a function-level and a TYPE_CHECKING import is still found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]
