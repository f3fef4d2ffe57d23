"""`make demo ARGS=--keep` killed with SIGKILL takes its workers and gateway with it; a second
demo meanwhile logs into its own directory and leaves the kept one's logs alone. Real `make`,
real demo, real worker and gateway processes."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.processes import alive, wait_dead

TINY = "--workers 1 --tenants 1 --users 1 --turns 1"

pytestmark = [pytest.mark.slow, pytest.mark.long]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


class Demo:
    """`make demo ARGS=...` with its output read line by line."""

    def __init__(self, args: str, log_dir: Path) -> None:
        self.proc = subprocess.Popen(
            ["make", "--no-print-directory", "demo", f"ARGS={args} --log-dir {log_dir}"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.seen)
                continue
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no {pattern!r} in {timeout:.0f}s:\n{''.join(self.seen)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def test_kill9_of_a_kept_demo_takes_its_cluster_and_a_second_demo_keeps_apart(
    tmp_path: Path,
) -> None:
    kept = Demo(f"--keep {TINY}", tmp_path)
    second = None
    cluster: list[int] = []
    try:
        logs = Path(kept.wait_for(r"logs in (\S+)\)", 120).group(1))
        kept.wait_for("The cluster keeps running", 300)
        (demo,) = children(kept.proc.pid)  # make -> python -m bench.demo -> worker, gateway
        cluster = children(demo)
        assert len(cluster) == 2 and all(alive(p) for p in cluster)
        before = {p.name: p.read_bytes() for p in logs.glob("*.log")}
        assert set(before) == {"worker-0.log", "gateway-0.log"} and all(before.values())

        second = Demo(TINY, tmp_path)
        second.wait_for(rf"another demo is running \(logs in {re.escape(str(logs))}\)", 120)
        other = Path(second.wait_for(r"logs in (\S+)\)", 120).group(1))
        second.wait_for(r"stopped the demo cluster", 300)
        assert second.proc.wait(30) == 0
        assert other != logs and (other / "worker-0.log").stat().st_size > 0
        for name, text in before.items():  # the kept run's logs: grown, never truncated
            assert (logs / name).read_bytes().startswith(text), name

        os.kill(kept.proc.pid, signal.SIGKILL)  # make itself, as `kill -9` of `make demo`
        assert wait_dead(demo, 30), "the demo outlived make"
        for pid in cluster:
            assert wait_dead(pid, 30), f"cluster process {pid} outlived the demo"
    finally:
        for d in (kept, second):
            if d is not None:
                d.stop()
        for pid in cluster:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
