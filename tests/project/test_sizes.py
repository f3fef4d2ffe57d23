"""Small files with one concern: no source file over 320 lines, no function over 60, in every
source package. GPU kernels (functions decorated `@triton.jit`) are exempt from the function
bound: a kernel's body is one launch's straight-line code, and splitting it costs registers."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

ROOTS = ("gateway", "cachekey", "harness", "bench", "kvgate_cli", "worker")
MAX_FILE_LINES = 320
MAX_FUNCTION_LINES = 60


def oversized(root: Path, roots: tuple[str, ...] = ROOTS) -> list[str]:
    out = []
    for name in roots:
        for path in sorted((root / name).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(root).as_posix()
            if (n := text.count("\n")) > MAX_FILE_LINES:
                out.append(f"{rel}: {n} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _kernel(node):
                    n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if n > MAX_FUNCTION_LINES:
                        out.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return out


def _kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def test_files_and_functions_within_the_size() -> None:
    assert oversized(REPO) == []


def test_the_check_finds_a_long_file_and_a_long_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    kernel = "@triton.jit\ndef k():\n" + body
    (tmp_path / "pkg" / "a.py").write_text("def f():\n" + body + kernel + "\n" * 238)
    assert oversized(tmp_path, ("pkg",)) == ["pkg/a.py: 361 lines", "pkg/a.py:1 f: 61 lines"]
