"""A log directory per run, held while the run lives, so two runs never write the same logs.

`claim_log_dir(base)` makes `base/<date>-<time>.<µs>-<pid>/` and takes an exclusive lock on a
file in it for the life of this process (the kernel drops it however the process ends). Older
run directories are pruned to the newest `keep`, except those still locked: a run that is still
going (`make demo ARGS=--keep`) keeps its logs. `base/latest` points at the newest run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

LOCK = ".running"
_held: list[int] = []  # lock fds, open for the life of the process


def _locked(run: Path) -> bool:
    """Whether a live process holds `run`'s lock."""
    try:
        fd = os.open(run / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this probe took
    return False


def running_runs(base: Path) -> list[Path]:
    """Run directories under `base` whose process still runs, oldest first."""
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink() and _locked(p))


def claim_log_dir(base: Path, keep: int = 5) -> Path:
    """A new run directory under `base`, locked by this process; prunes old finished runs."""
    base.mkdir(parents=True, exist_ok=True)
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    run = base / f"{stamp}-{os.getpid()}"  # names sort by start time
    run.mkdir()
    fd = os.open(run / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held.append(fd)
    runs = sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())
    for old in runs[:-keep] if keep else runs:
        if old != run and not _locked(old):
            shutil.rmtree(old, ignore_errors=True)
    latest = base / "latest"
    tmp = base / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run.name)
    os.replace(tmp, latest)
    return run
