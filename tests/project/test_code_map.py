"""docs/code-map.md's request paths are true to the code and move down the gateway's floors.

Every `gateway/....py:Name` it cites is defined there (a class, a function, or a class's method).
On each path (HTTP, EPP) the numbered stops, taken as the module each one starts in, go down the
floors of tests/project/test_layers.py or stay on one, and come back to a module already left at
most twice (with the answer, and for the end).
"""

from __future__ import annotations

import ast
import re

from tests.project.test_layers import FLOORS, floor_of
from tests.support.paths import REPO

DOC = REPO / "docs" / "code-map.md"
REF = re.compile(r"`(gateway/[\w/]+\.py):([\w.]+)`")
STOP = re.compile(r"^\d+\. .*?`(gateway/[\w/]+\.py)[:`]", re.MULTILINE)


def _section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def _defines(path: str, dotted: str) -> bool:
    tree = ast.parse((REPO / path).read_text())
    scope: list[ast.stmt] = tree.body
    for name in dotted.split("."):
        found = [
            n
            for n in scope
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name == name
        ]
        if not found:
            return False
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


def _package(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return parts[1]


def returns_and_climbs(stops: list[str]) -> tuple[list[str], list[str]]:
    """The stops that come back to a module already left, and the other moves that go up."""
    level = floor_of(FLOORS)
    back, up = [], []
    for i in range(1, len(stops)):
        prev, cur = stops[i - 1], stops[i]
        if cur != prev and cur in stops[:i]:
            back.append(cur)
        elif level[_package(cur)] > level[_package(prev)]:
            up.append(f"{prev} -> {cur}")
    return back, up


def test_every_cited_gateway_function_exists() -> None:
    text = _section(DOC.read_text(), "## A request through the gateway", "## An engine step")
    missing = [f"{p}:{n}" for p, n in REF.findall(text) if not _defines(p, n)]
    assert not missing, f"docs/code-map.md cites what the code does not define: {missing}"


def test_both_paths_move_down_with_at_most_two_returns() -> None:
    text = DOC.read_text()
    for start, end in (("**HTTP**", "**Beside the request path**"), ("**EPP**", "## An")):
        stops = STOP.findall(_section(text, start, end))
        assert len(stops) >= 5, (start, stops)
        back, up = returns_and_climbs(stops)
        assert len(back) <= 2 and not up, (start, stops, back, up)


def test_the_counter_sees_a_bouncing_path_and_a_climb() -> None:
    """The path as it was before issue 37 (issue 37's own count: 7 returns in 15 stops), and a
    stop that goes up to a module not seen yet."""
    http, routing = "gateway/http/serving.py", "gateway/routing/request.py"
    stops = [http, routing, http, routing, "gateway/limits.py", routing, http]
    assert returns_and_climbs(stops) == ([http, routing, routing, http], [])
    climb = ["gateway/serving/exchange.py", routing, "gateway/serving/retry.py"]
    assert returns_and_climbs(climb) == ([], [f"{routing} -> gateway/serving/retry.py"])
