"""Whether a process still runs, read from /proc (Linux), for the lifetime tests."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def children(pid: int) -> list[int]:
    """The processes `pid` started that still run (Linux's /proc children list)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(c) for c in text.split() if alive(int(c))]
