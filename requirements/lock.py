"""`make lock`: the exact versions, with hashes, that `make test`, CI and the images install.

One universal resolution (every platform, CPython 3.11) of all of pyproject.toml's extras plus
torch as requirements/torch.in pins it, from PyPI only, of releases uploaded before
--exclude-newer: the same inputs give the same files. The other locks are cut from it (it is
their constraint), so an image holds the versions the tests ran with.

    dev.lock      make test and CI: every extra; no torch, no CUDA runtime
    gateway.lock  docker/gateway.Dockerfile: the gateway extra
    worker.lock   docker/worker.Dockerfile: the worker extra and torch's own dependencies
    cuda.lock     the CUDA worker image: the CUDA runtime torch's PyPI wheel needs

torch itself is in none of them: which build is right (CPU index, PyPI's CUDA wheel, a local
wheel) depends on where it is installed, and each build has its own hashes. It is installed
with --no-deps after a lock, at requirements/torch.in's version; `pip check` then proves the
set whole.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYPROJECT = ROOT / "pyproject.toml"
TORCH_IN = HERE / "torch.in"
EXTRAS = ("gateway", "worker", "test", "bench")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", re.MULTILINE)


def is_cuda_runtime(name: str) -> bool:
    """Packages that only torch's CUDA build needs (triton: its GPU kernel compiler)."""
    return name.startswith(("nvidia-", "cuda-")) or name == "triton"


def compile_lock(uv: str, args: argparse.Namespace, out: Path, *inputs: str) -> set[str]:
    """Run `uv pip compile` into `out`; the names it pinned."""
    cmd = [
        uv, "pip", "compile", *inputs,
        "--universal", "--python-version", args.python,
        "--generate-hashes", "--index-url", "https://pypi.org/simple", "--system-certs",
        "--exclude-newer", args.exclude_newer,
        "--custom-compile-command", "make lock", "--no-annotate",
        "--quiet", "-o", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return {m.lower() for m in PIN.findall(out.read_text())}


def without(names: set[str]) -> list[str]:
    return [arg for name in sorted(names) for arg in ("--no-emit-package", name)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uv", default="uv")
    ap.add_argument("--exclude-newer", required=True, help="a date: PyPI as it was then")
    ap.add_argument("--python", default="3.11")
    args = ap.parse_args()

    extras = [arg for e in EXTRAS for arg in ("--extra", e)]
    torch_in = str(TORCH_IN)
    with tempfile.TemporaryDirectory() as tmp:
        every = Path(tmp) / "all.txt"
        print(f"resolving pyproject.toml [{','.join(EXTRAS)}] + requirements/torch.in")
        names = compile_lock(args.uv, args, every, str(PYPROJECT), *extras, torch_in)
        pinned = ("-c", str(every))
        cuda = {n for n in names if is_cuda_runtime(n)}
        project = str(PYPROJECT)
        # The tests run triton's interpreter on the CPU (the test extra), so dev.lock keeps it.
        locks = {
            "dev.lock": (project, *extras, torch_in, *without({"torch"} | cuda - {"triton"})),
            "gateway.lock": (project, "--extra", "gateway"),
            "worker.lock": (project, "--extra", "worker", torch_in, *without({"torch"} | cuda)),
            "cuda.lock": (torch_in, *without(names - cuda)),
        }
        for name, inputs in locks.items():
            got = compile_lock(args.uv, args, HERE / name, *inputs, *pinned)
            print(f"  requirements/{name}: {len(got)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
