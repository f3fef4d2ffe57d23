"""Where a running Python process spends its time: py-spy (`pip install py-spy`; not a kvgate
dependency) samples it from outside, and the collapsed stacks are summed per function, by the
time spent in it (self) and under it (inclusive)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def available() -> str | None:
    """The py-spy binary next to this Python, or on PATH; None when not installed."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """Start sampling `pid` for `seconds` (100 samples/s, idle threads left out) into `out`."""
    exe = available()
    if exe is None:
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    args = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100"]
    args += ["--format", "raw", "--output", str(out), "--nonblocking"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarize(raw: Path, top: int = 15) -> dict[str, list[tuple[str, float]]]:
    """The `top` functions by share of the samples: self (the leaf frame) and inclusive."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            under[f] += n
    share = lambda c: [(f, round(n / max(total, 1), 3)) for f, n in c.most_common(top)]  # noqa: E731
    return {"samples": [("all", float(total))], "self": share(own), "inclusive": share(under)}


def _short(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py)`: lines merged per function."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0]
    parts = Path(path).parts
    return f"{name} ({'/'.join(parts[-2:])})" if parts else name
