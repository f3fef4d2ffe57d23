r"""The kit a lent GPU machine needs beside this checkout to run `bash bench/gpu.sh`.

The device's image (bench/lib/gpu_image.py) holds torch, transformers, triton and much more,
not kvgate's web and messaging stack, and that machine reaches no package index. This finds
what bench/gpu.sh's runs import that the image lacks, by running them small on this CPU with
every Python process's imports logged (bench/lib/import_log.py: the gateway, the workers and
their engine cores included), and downloads those distributions at the versions installed here
(requirements/dev.lock's) as CPython 3.12 Linux x86_64 wheels into `.whl/`; bench/gpu.sh
installs them there. It copies the measurement kit (`--devtools-from`, ../shared/gpu) into
`.devtools/`. A hand-made list misses what a dependency pulls in (FastAPI's own
opentelemetry-api, say), and a run that fails on an import costs minutes of device time.

    python -m bench.gpu_kit            # .whl/ and .devtools/, then how to carry them
    python -m bench.gpu_kit --check    # only what the image lacks, with versions (no download)

About a minute (a one-worker bench.ttft on a tiny random Llama), then the downloads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.lib.gpu_image import IMAGE
from bench.lib.import_log import distributions, run_logged

ROOT = Path(__file__).resolve().parents[1]
# The checkout itself travels: its own (editable) install is never a wheel to carry. Which of
# its files an import log names depends on how the venv was made (a fresh clone's editable
# finder is one of them).
OWN = "kvgate"
CARRY_LIMIT = 64 * 2**20  # the working tree and what `run` carries, together
PY = sys.executable
# What bench/gpu.sh runs, small: bench.ttft as `ttft` and `routing` run it (gateway, torch
# workers, engine cores; llama-tiny takes llama-1b's code path), the other benches' modules,
# and the engine and model tests `tests` collects.
PROBES = (
    (PY, "-m", "bench.ttft", "--model", "llama-tiny", "--workers", "1", "--tenants", "1",
     "--users-per-tenant", "2", "--turns", "1", "--rounds", "1", "--concurrency", "2",
     "--policies", "round_robin,cache_aware", "--num-blocks", "256", "--max-tokens", "4"),
    (PY, "-c", "import bench.engine, bench.engine_ab, bench.async_mix, bench.host_tier, "
     "bench.decode_profile"),
    (PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
     "tests/worker/engine", "tests/worker/models"),
)  # fmt: skip
# pip matches a manylinux tag exactly: every glibc 2.x a wheel may name, and the older aliases.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def lacking(work: Path) -> dict[str, str]:
    """{distribution: version} that the probes import and the device image does not hold."""
    log = work / "imports.log"
    out = ("--out", str(work / "ttft.json"), "--log-dir", str(work / "logs"))
    models = ("--models-dir", str(work / "models"))
    probes = [PROBES[0] + out + models, *PROBES[1:]]
    run_logged(probes, ROOT, log)
    return {name: v for name, v in distributions(log).items() if name not in IMAGE | {OWN}}


def download(wanted: dict[str, str], dest: Path) -> list[Path]:
    """The wheels of `wanted` for CPython 3.12 on Linux x86_64, into `dest` (emptied first)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-whl-") as tmp:
        cmd = [PY, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
        cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
        cmd += ["-d", tmp, *(f"{n}=={v}" for n, v in wanted.items())]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"error: pip download failed:\n{done.stderr[-3000:]}")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for wheel in Path(tmp).glob("*.whl"):
            shutil.move(wheel, dest / wheel.name)
    return sorted(dest.glob("*.whl"))


def tree_bytes() -> int:
    """Bytes of the files `run` copies of the working tree (tracked and untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = (ROOT / p.decode() for p in listed.split(b"\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="print what the image lacks; no download")
    ap.add_argument("--devtools-from", type=Path, default=ROOT.parent / "shared" / "gpu")
    ap.add_argument("--out", type=Path, help="also write {distribution: version} here (JSON)")
    args = ap.parse_args()
    print("running bench/gpu.sh's code small, every import logged:", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvgate-kit-") as work:
        wanted = lacking(Path(work))
    pins = ", ".join(f"{n}=={v}" for n, v in wanted.items())
    print(f"the device image lacks {len(wanted)}: {pins}")
    if args.out:
        args.out.write_text(json.dumps(wanted, indent=1) + "\n")
    if args.check:
        return
    wheels = download(wanted, ROOT / ".whl")
    print(f".whl/: {len(wheels)} wheels, {folder_bytes(ROOT / '.whl') / 2**20:.1f} MiB")
    if args.devtools_from.is_dir():
        shutil.copytree(args.devtools_from, ROOT / ".devtools", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        print(f".devtools/: copied from {args.devtools_from}")
    else:
        print(f"note: no {args.devtools_from}: .devtools/ not filled (bench/gpu.sh tests needs it)")
    carried = tree_bytes() + folder_bytes(ROOT / ".whl") + folder_bytes(ROOT / ".devtools")
    print(f"the working tree with both: {carried / 2**20:.1f} MiB of the 64 MiB a run may carry")
    if carried > CARRY_LIMIT:
        sys.exit("error: over the limit: remove untracked files from the working tree")
    print('then: run(carry=[".devtools", ".whl"], command="OUT=$OUT bash bench/gpu.sh MODE")')


if __name__ == "__main__":
    main()
