"""Every `x-*` header name is spelled in one module of gateway/, worker/ and cachekey/
(cachekey/headers.py); the others import it. Read with `ast`, so comments, docstrings and
prose that mentions a header (an error message, a flag's help) do not count: a literal counts
when it is a header name itself, or a raw header line that starts with one (`b"x-...: %d"`).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tests.support.paths import REPO

PACKAGES = ("gateway", "worker", "cachekey")
_NAME = re.compile(r"^(x-[a-z0-9-]*[a-z0-9])(?::|$)", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def header_literals(source: str) -> set[str]:
    """The lower-cased `x-*` header names that `source` spells as string or bytes literals."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in skip:
            continue
        value = node.value
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(value, str) and (m := _NAME.match(value)):
            names.add(m.group(1).lower())
    return names


def test_the_check_sees_literals_and_not_prose():
    source = '''"""x-kvgate-replica in a docstring"""
# "x-kvgate-prefix" in a comment
A = "x-data-parallel-rank"
B = b"X-Data-Parallel-Rank: %d\\r\\n"
C = f"x-session-id is {1}"
D = "X-data-parallel-rank must be an integer"
'''
    assert header_literals(source) == {"x-data-parallel-rank"}


def test_no_header_name_is_spelled_in_two_modules():
    where: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for name in header_literals(path.read_text()):
                where[name].append(str(path.relative_to(REPO)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"spell these once, in cachekey/headers.py: {twice}"
    assert set(where) and {Path(p).name for ps in where.values() for p in ps} == {"headers.py"}
