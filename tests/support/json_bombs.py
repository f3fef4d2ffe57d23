"""Element-heavy JSON bodies and the /proc readings that show what they cost a process.

Shared by the gateway's and the worker's memory tests (issue 14, finding 5), which send the
same bodies to each and measure the peak the same way.
"""

from __future__ import annotations

from pathlib import Path


def many_keys(size: int) -> bytes:
    """`{"k0000000": 0, ...}` of about `size` bytes (3 million keys at 32 MiB)."""
    n = (size - 2) // 13
    return b"{" + b",".join(b'"k%07d":0' % i for i in range(n)) + b"}"


def many_objects(size: int) -> bytes:
    """`{"messages": [...], "x": [{}, {}, ...]}`: millions of empty objects."""
    n = (size - 100) // 3
    head = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "x": ['
    return head + b",".join([b"{}"] * n) + b"]}"


def reset_peak_rss(pid: int) -> int:
    """The process's current RSS in KiB, after resetting its peak (VmHWM) to it."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_kib(pid, "VmRSS")


def status_kib(pid: int, field: str) -> int:
    """A KiB field (VmRSS, VmHWM) of /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")
