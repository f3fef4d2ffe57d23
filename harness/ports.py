"""Free ports on 127.0.0.1 for the processes a test or benchmark starts (harness/cluster.py)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def _handout_range() -> range:
    """Ports below the kernel's ephemeral range (where outgoing connections take theirs)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), max(2048, low))


_RANGE = _handout_range()
_next_port = random.Random().randrange(len(_RANGE))
_handed: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port(preferred: int | None = None) -> int:
    """`preferred` when it is free on HOST, otherwise a free port nobody else was handed.

    The port is for another process to bind later. A port the kernel picks (bind to 0) can be
    taken in the meantime by any outgoing connection, which draws from the same ephemeral range;
    so ports come from just below that range, each handed out once per process, from a random
    start that keeps concurrent test runs apart.
    """
    global _next_port
    if preferred and _bindable(preferred):
        return preferred
    for _ in range(len(_RANGE)):
        port = _RANGE[_next_port % len(_RANGE)]
        _next_port += 1
        if port not in _handed and _bindable(port):
            _handed.add(port)
            return port
    raise OSError("no free port")


def free_port_run(n: int) -> int:
    """A port p such that p .. p + n - 1 are all free (a base port and its ranks' offsets)."""
    while True:
        run = [free_port()]
        while len(run) < n and (q := free_port()) == run[-1] + 1:
            run.append(q)
        if len(run) == n:
            return run[0]
