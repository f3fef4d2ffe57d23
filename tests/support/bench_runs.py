"""A bench/ script run as its user runs it (`python -m bench.NAME ...`), for the tests of what a
benchmark reports. Tests never import bench (tests/project/test_no_bench_imports.py): what they
share with it is in harness/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO


def run_bench(name: str, out: Path, *args: str, timeout: float = 600.0) -> dict:
    """`python -m bench.<name> ARGS --out OUT` from the repository; returns the JSON it wrote.
    A failed run fails the test with the script's own output."""
    cmd = [sys.executable, "-m", f"bench.{name}", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    return json.loads(out.read_text())
