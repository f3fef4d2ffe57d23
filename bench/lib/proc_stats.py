"""CPU time and memory of processes from /proc (Linux): what a benchmark charges to a process,
whatever else runs on the machine."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process, every thread included."""
    return _cpu(Path(f"/proc/{pid}/stat"))


def own_and_below(pids: list[int], since: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """CPU seconds of these processes, and of every live process below them (workers' API
    servers, and their engine cores), less `since` (an earlier reading)."""
    own = sum(cpu_seconds(p) for p in pids)
    below = sum(tree_cpu_seconds(p) for p in pids) - own
    return own - since[0], below - since[1]


class CpuMeter:
    """`own_and_below` of fixed processes from `start()` (a run's first request, not the
    settling before it) to `spent()`."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.at = own_and_below(pids)

    def start(self) -> None:
        self.at = own_and_below(self.pids)

    def spent(self) -> tuple[float, float]:
        return own_and_below(self.pids, since=self.at)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and of every live process below it (a worker and its engine
    core processes)."""
    total = cpu_seconds(pid)
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return total
    for kid in kids:
        with contextlib.suppress(FileNotFoundError):  # it exited meanwhile
            total += tree_cpu_seconds(int(kid))
    return total
