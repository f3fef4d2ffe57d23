"""The gateway's packages are floors: a package imports only the floors below it.

Every import statement counts (function-level and `if TYPE_CHECKING:` ones too), read from the
source with the import-cycle test's ast reader. A "package" is a top-level module or subpackage
of gateway/ (gateway/fleet/replica.py belongs to `fleet`); imports inside one package are free.
Two packages on the same floor may not import each other: http/ and epp/ are two entry points
over the same request path, and neither calls the other.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.project.test_import_cycles import import_graph
from tests.support.paths import REPO

# Bottom first: the names and pacing every package uses, then what the request path is made of,
# the request path itself (serving), its two entry points, the app that composes them, the CLI.
FLOORS: tuple[frozenset[str], ...] = tuple(
    frozenset(f.split())
    for f in (
        "names pace tasks metrics",
        "limits protocol assets upstream discovery images quarantine",
        "errors config_checks cost_weights",
        "config",
        "index",
        "events",
        "fleet",
        "peers",
        "accounting",
        "routing",
        "state",
        "serving",
        "http epp",
        "app",
        "cli",
        "__main__",
    )
)

# Upward imports not yet removed ("from -> to"): empty, and it stays so.
KNOWN: frozenset[str] = frozenset()


def _package(module: str, root: str) -> str | None:
    parts = module.split(".")
    if parts[0] != root or len(parts) == 1:
        return None
    return parts[1]


def floor_of(floors: tuple[frozenset[str], ...]) -> dict[str, int]:
    return {pkg: i for i, floor in enumerate(floors) for pkg in floor}


def upward_imports(
    root: Path = REPO, package: str = "gateway", floors: tuple[frozenset[str], ...] = FLOORS
) -> tuple[dict[str, list[str]], set[str]]:
    """("from -> to" -> the module imports behind it) for every import that is not downward,
    and the packages no floor names."""
    level = floor_of(floors)
    upward: dict[str, list[str]] = {}
    undeclared: set[str] = set()
    for module, deps in import_graph(root, (package,)).items():
        src = _package(module, package)
        if src is None:
            continue
        if src not in level:
            undeclared.add(src)
            continue
        for dep in sorted(deps):
            dst = _package(dep, package)
            if dst is None or dst == src:
                continue
            if dst not in level:
                undeclared.add(dst)
            elif level[dst] >= level[src]:
                upward.setdefault(f"{src} -> {dst}", []).append(f"{module} -> {dep}")
    return upward, undeclared


def test_gateway_packages_import_only_floors_below() -> None:
    upward, undeclared = upward_imports()
    assert not undeclared, f"gateway packages on no floor (add them to FLOORS): {undeclared}"
    new = {k: v for k, v in upward.items() if k not in KNOWN}
    assert not new, "imports that are not downward:\n" + "\n".join(
        f"  {k}: {', '.join(v)}" for k, v in sorted(new.items())
    )
    gone = KNOWN - upward.keys()
    assert not gone, f"no longer upward, remove from KNOWN: {sorted(gone)}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_fails_on_a_planted_upward_import(tmp_path: Path) -> None:
    """A lower floor importing a higher one is found, hidden in a function or under
    TYPE_CHECKING; a downward import is not; a peer on the same floor is."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from pkg.high import b\n",
            "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.mid\n",
            "mid.py": "from pkg.low import a\n",
            "peer.py": "from . import mid\n",
            "high/__init__.py": "",
            "high/b.py": "from pkg.low.a import f\nfrom pkg import mid\n",
        },
    )
    floors = (frozenset({"low"}), frozenset({"mid", "peer"}), frozenset({"high"}))
    upward, undeclared = upward_imports(root, "pkg", floors)
    assert undeclared == set()
    assert upward == {
        "low -> high": ["pkg.low.a -> pkg.high.b"],
        "low -> mid": ["pkg.low.c -> pkg.mid"],
        "peer -> mid": ["pkg.peer -> pkg.mid"],
    }


def test_a_package_on_no_floor_is_reported(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "low.py": "", "new.py": "import pkg.low\n"})
    _, undeclared = upward_imports(root, "pkg", (frozenset({"low"}),))
    assert undeclared == {"new"}


def test_the_real_tree_with_a_planted_upward_import_fails(tmp_path: Path) -> None:
    """The real gateway/, copied, with one upward import planted at the bottom (names -> http):
    the checker fails it, and finds nothing else."""
    shutil.copytree(REPO / "gateway", tmp_path / "gateway")
    names = tmp_path / "gateway" / "names.py"
    names.write_text(names.read_text() + "\n\ndef _planted():\n    import gateway.http.routes\n")
    upward, undeclared = upward_imports(tmp_path, "gateway")
    assert upward == {"names -> http": ["gateway.names -> gateway.http.routes"]}
    assert undeclared == set()
