"""What a built image holds, checked against the lock it was built from (`harness.images`).

An image passes when the distributions installed in its /opt/kvgate are exactly its lock's pins
for the image's platform (the markers evaluated inside it; a CUDA worker's also cuda.lock's),
plus kvgate's own wheel, torch at
requirements/torch.in's version (worker) and pip/setuptools/wheel where the lock has none; and
when it holds no source tree (/app, /src), no egg-info, and kvgate's modules compiled.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(?:\s*;\s*([^\\]+?))?\s*\\?$")
# Installed by the venv or the build, not by a lock: checked only when a lock pins them.
TOOLS = {"pip", "setuptools", "wheel"}

# Runs inside the image: its marker environment, its distributions, what lies where.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, sys
from pip._vendor.packaging.markers import default_environment
dists = {d.metadata["Name"]: d.version for d in md.distributions()}
kvgate = md.distribution("kvgate")
mods = {m: importlib.util.find_spec(m) for m in ("cachekey", "kvgate_cli", "gateway", "worker")}
print(json.dumps({
    "env": default_environment(),
    "dists": dists,
    "kvgate_files": [str(f) for f in kvgate.files or ()],
    "modules": {m: s.origin if s else None for m, s in mods.items()},
    "sources": [p for p in ("/app", "/src") if os.path.exists(p)],
    "prefix": sys.prefix,
}))
"""


def torch_version() -> str:
    text = (ROOT / "requirements" / "torch.in").read_text()
    (version,) = re.findall(r"^torch==(\S+)$", text, re.MULTILINE)
    return version


def cpu_torch_wheel() -> Path | None:
    """A CPU torch wheel of requirements/torch.in's version in pip's find-links, if any."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    dirs = {
        d
        for line in out.splitlines()
        if "find-links=" in line
        for d in line.split("=", 1)[1].strip("'\"").split()
    }
    machine = {"x86_64": "x86_64", "aarch64": "aarch64"}.get(__import__("platform").machine())
    pattern = f"torch-{torch_version()}+cpu-cp311-cp311-*{machine}.whl"
    for d in sorted(dirs):
        found = sorted(Path(d).glob(pattern)) if Path(d).is_dir() else []
        if found:
            return found[0]
    return None


def lock_pins(lock: Path, env: dict[str, str]) -> dict[str, str]:
    """name -> version of every pin of `lock` whose marker holds in `env`."""
    pins = {}
    for line in lock.read_text().splitlines():
        m = PIN.match(line)
        if m and (m.group(3) is None or Marker(m.group(3)).evaluate(env)):
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def probe(engine: str, image: str) -> dict:
    out = subprocess.run(
        [engine, "run", "--rm", "--entrypoint", "python", image, "-c", PROBE],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def check_image(engine: str, image: str, lock: Path) -> str:
    """Raise AssertionError on what differs from `lock`; a one-line summary otherwise."""
    got = probe(engine, image)
    want = lock_pins(lock, got["env"])
    have = {canonicalize_name(n): v for n, v in got["dists"].items()}
    locks = [lock]
    if "worker" in lock.name and any(n.startswith("nvidia-") for n in have):  # a CUDA build
        locks.append(lock.with_name("cuda.lock"))
        want |= lock_pins(locks[-1], got["env"])
    extra = {"kvgate": have.get("kvgate")} | {t: have[t] for t in TOOLS - want.keys() if t in have}
    if "worker" in lock.name:
        extra["torch"] = have.get("torch")
        assert (have.get("torch") or "").split("+")[0] == torch_version(), have.get("torch")
    missing = {n: v for n, v in want.items() if have.get(n) != v}
    unlocked = {n: v for n, v in have.items() if n not in want and n not in extra}
    assert not missing and not unlocked, f"{image}: not as locked {missing=} {unlocked=}"
    assert not got["sources"], f"{image}: source trees {got['sources']}"
    files = got["kvgate_files"]
    assert not [f for f in files if ".egg-info" in f], f"{image}: kvgate egg-info"
    assert any(f.endswith(".pyc") for f in files), f"{image}: kvgate's modules are not compiled"
    site = f"{got['prefix']}/lib/python3.11/site-packages/"
    for module, origin in got["modules"].items():
        assert origin is None or origin.startswith(site), f"{module} runs from {origin}"
    size = subprocess.run(
        [engine, "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True
    ).stdout.strip()
    mods = sorted(m for m, o in got["modules"].items() if o)
    return (
        f"images-test: {image}: {len(want)} packages exactly as "
        f"{' + '.join(str(p.relative_to(ROOT)) for p in locks)}, "
        f"+ {', '.join(f'{n} {v}' for n, v in sorted(extra.items()))}; kvgate ({', '.join(mods)}) "
        f"installed compiled in {site}, no source tree; {int(size or 0) / 1e6:.0f} MB"
    )
