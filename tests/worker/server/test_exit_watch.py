"""ExitWatch with real processes on a real event loop: a killed process is seen through its
pidfd, or by polling where Python or the kernel has no pidfd_open; a stopped watch calls nothing."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from worker.server import exit_watch
from worker.server.exit_watch import ExitWatch, open_pidfd


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(params=["pidfd", "polled"])
def watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, sleeper) -> ExitWatch:
    if request.param == "polled":
        monkeypatch.delattr(os, "pidfd_open", raising=False)  # as on macOS
    w = ExitWatch(sleeper)
    assert (w.pidfd is None) == (request.param == "polled" or not hasattr(os, "pidfd_open"))
    yield w
    w.close()


async def _exits_seen(w: ExitWatch, stop_first: bool) -> list[float]:
    """Kill the process while `w` watches (or after it stopped); when each call came, after the
    kill: waiting up to 5 s for the first, then three polls more for any second one."""
    seen: list[float] = []
    w.start(asyncio.get_running_loop(), lambda: seen.append(time.monotonic()))
    await asyncio.sleep(0.2)
    if stop_first:
        w.stop()
    os.kill(w.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while not seen and not stop_first and time.monotonic() - killed < 5.0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(3 * exit_watch.POLL_S)
    w.stop()
    return [t - killed for t in seen]


def test_a_killed_process_is_seen_once_and_soon(watch: ExitWatch) -> None:
    after = asyncio.run(_exits_seen(watch, stop_first=False))
    assert len(after) == 1
    # A poll's interval (or at once), not the 30 s stall watchdog; loose for a busy host.
    assert after[0] < 1.0


def test_a_stopped_watch_calls_nothing(watch: ExitWatch) -> None:
    assert asyncio.run(_exits_seen(watch, stop_first=True)) == []
    watch.stop()  # a second stop does nothing


def test_a_kernel_that_refuses_pidfd_open_means_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")  # Linux before 5.3

    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    assert open_pidfd(os.getpid()) is None
