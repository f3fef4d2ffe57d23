"""No test imports bench/: the benchmarks are scripts, not a library. What tests and benchmarks
share lives in harness/ (as vLLM's tests share their utils module); a test about a benchmark runs it
as its user does, `python -m bench.NAME` (tests/support/bench_runs.py).

Every import statement counts, inside functions too, and so does `importlib.import_module`
with a literal name; the source is read (ast), so a lazy import on a path no test takes fails
here as well."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

TESTS = REPO / "tests"


def _names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every module the source imports."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def bench_imports(source: str, filename: str = "<test>") -> list[str]:
    """`file:line module` for each import of bench or a module under it."""
    tree = ast.parse(source, filename=filename)
    return [
        f"{filename}:{line} {name}"
        for line, name in _names(tree)
        if name == "bench" or name.startswith("bench.")
    ]


def test_no_test_imports_bench() -> None:
    paths = sorted(TESTS.rglob("*.py"))
    # Not vacuous: the scan reads the support package and this file too.
    assert {TESTS / "support" / "bench_runs.py", Path(__file__)} <= set(paths)
    found = [hit for p in paths for hit in bench_imports(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, "tests import bench; share it through harness/:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import() -> None:
    source = """
import bench
import bench.hit_rate as hr
from bench.lib.floor import startup_floor
def lazy():
    from bench import hidden_prefill
    importlib.import_module("bench.engine")
import benchmark_tools
from harness.floor import startup_floor
from tests.support.bench_runs import run_bench
"""
    found = [hit.split(" ", 1)[1] for hit in bench_imports(source)]
    assert found == ["bench", "bench.hit_rate", "bench.lib.floor", "bench", "bench.engine"]
