"""Every test the docs and the code cite exists: a `tests/...` path names a file or folder that is
there (a glob matches at least one), and `tests/x.py::name` names a test function or class that
file defines. A test file cited by its bare name would be ambiguous (several folders hold a
`test_errors.py`), so citations give the path from the repository root."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import REPO

# Where tests are cited: the docs, the README, code comments and docstrings, chart values, scripts.
READ = ("README.md", "Makefile", "pyproject.toml", ".ci", ".github", "docs", "bench", "harness",
        "gateway", "worker", "cachekey", "kvgate_cli", "helm", "manifests", "docker",
        "tests")  # fmt: skip
SKIP = ("bench/results", "tests/fixtures/vllm_0_33", "tests/fixtures/vllm_cpu_0_32")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ""}
CITED = re.compile(r"(?<![\w/.])tests/[\w/.*-]*[\w*/](?:::\w+)?")
BARE = re.compile(r"(?<![\w/.*])test_\w+\.py\b")


def cited_files() -> list[Path]:
    files = []
    for name in READ:
        root = REPO / name
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for p in paths:
            rel = p.relative_to(REPO).as_posix()
            if p.is_file() and p.suffix in SUFFIXES and not rel.startswith(SKIP):
                files.append(p)
    return files


def defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


def broken(text: str) -> list[str]:
    """The citations in `text` that name nothing."""
    bad = []
    for ref in CITED.findall(text):
        path, _, name = ref.partition("::")
        matches = list(REPO.glob(path.rstrip("/"))) if "*" in path else [REPO / path]
        if (
            not all(m.exists() for m in matches)
            or not matches
            or (name and (path.endswith("*.py") or name not in defined(REPO / path)))
        ):
            bad.append(ref)
    bad += [f"{b} (bare name: give its path)" for b in BARE.findall(text)]
    return bad


def test_every_cited_test_exists() -> None:
    files = cited_files()
    assert REPO / "docs" / "reliability.md" in files and REPO / "README.md" in files
    files.remove(Path(__file__))  # its docstring and its test of the check cite on purpose
    found = [f"{p.relative_to(REPO)}: {ref}" for p in files for ref in broken(p.read_text())]
    assert not found, "\n".join(found)


def test_the_check_finds_what_names_nothing() -> None:
    text = (
        "see `tests/gateway/test_index.py`, tests/gateway/ and tests/system/test_faults_*.py;\n"
        "tests/gateway/test_index.py::nope, tests/test_gateway_index.py, test_gateway_e2e.py,\n"
        "tests/worker/engine/test_block_manager.py::test_ref_counts_with_shared_prefix"
    )
    assert broken(text) == [
        "tests/gateway/test_index.py::nope",
        "tests/test_gateway_index.py",
        "test_gateway_e2e.py (bare name: give its path)",
    ]
