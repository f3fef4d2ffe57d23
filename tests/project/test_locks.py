"""requirements/*.lock: in step with pyproject.toml, cut from one resolution, every pin hashed;
the environment these tests run in is dev.lock; the Makefile and the images install from them."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from harness.image_checks import PIN, lock_pins, torch_version
from tests.support.paths import REPO

REQ = REPO / "requirements"
LOCKS = ("dev.lock", "gateway.lock", "worker.lock", "cuda.lock")


def entries(lock: str) -> dict[str, list[tuple[str, str]]]:
    """name -> [(version, the entry's text)] of every pin in `lock`."""
    out: dict[str, list[tuple[str, str]]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", (REQ / lock).read_text()):
        m = PIN.match(block.splitlines()[0])
        if m:
            out.setdefault(canonicalize_name(m.group(1)), []).append((m.group(2), block))
    return out


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_every_project_requirement_is_pinned_within_its_range() -> None:
    """pyproject.toml changed without `make lock` fails here (the lead reruns it after merges)."""
    dev = entries("dev.lock")
    for req in project_requirements():
        name = canonicalize_name(req.name)
        assert name in dev, f"{req} is not in requirements/dev.lock: run make lock"
        for version, _ in dev[name]:
            assert req.specifier.contains(version, prereleases=True), f"{req} vs {version}"


def test_image_locks_hold_the_versions_the_tests_run() -> None:
    dev = {n: {v for v, _ in pins} for n, pins in entries("dev.lock").items()}
    for lock in ("gateway.lock", "worker.lock"):
        for name, pins in entries(lock).items():
            assert {v for v, _ in pins} <= dev.get(name, set()), f"{lock}: {name}"


def test_torch_is_in_no_lock_and_cuda_lock_only_its_runtime() -> None:
    for lock in LOCKS:
        assert "torch" not in entries(lock), lock
    cuda = entries("cuda.lock")
    assert "triton" in cuda and any(n.startswith("nvidia-") for n in cuda)
    assert all(n.startswith(("nvidia-", "cuda-")) or n == "triton" for n in cuda)
    assert not [n for n in entries("worker.lock") if n.startswith("nvidia-") or n == "triton"]


def test_every_pin_carries_hashes() -> None:
    for lock in LOCKS:
        for name, pins in entries(lock).items():
            for version, block in pins:
                assert "--hash=sha256:" in block, f"{lock}: {name}=={version} has no hash"


def test_this_environment_is_dev_lock() -> None:
    """`make test` installs dev.lock (and torch at requirements/torch.in's version)."""
    want = lock_pins(REQ / "dev.lock", default_environment())
    wrong = {}
    for name, version in want.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            wrong[name] = (version, have)
    assert not wrong, f"(locked, installed): {wrong}; rerun make test to reinstall"
    assert importlib.metadata.version("torch").split("+")[0] == torch_version()


def test_installs_read_the_locks_with_hashes() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "requirements/install.sh" in makefile  # the venv's install, which reads the locks
    install = (REPO / "requirements" / "install.sh").read_text()
    assert "--require-hashes --no-deps -r requirements/dev.lock" in install
    assert "--require-hashes --no-deps -r requirements/cuda.lock" in install
    for dockerfile, locks in (
        ("gateway.Dockerfile", ["gateway.lock"]),
        ("worker.Dockerfile", ["worker.lock", "cuda.lock"]),
    ):
        text = (REPO / "docker" / dockerfile).read_text()
        for lock in locks:
            assert f"--require-hashes --no-deps -r /tmp/req/{lock}" in text, (dockerfile, lock)
