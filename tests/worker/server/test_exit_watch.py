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


async def _exits_seen(w: ExitWatch, kill_after: float, wait: float, stop_first: bool) -> list:
    seen: list[float] = []
    loop = asyncio.get_running_loop()
    w.start(loop, lambda: seen.append(time.monotonic()))
    await asyncio.sleep(kill_after)
    if stop_first:
        w.stop()
    os.kill(w.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.sleep(wait)
    w.stop()
    return [t - killed for t in seen]


def test_a_killed_process_is_seen_once_and_soon(watch: ExitWatch) -> None:
    after = asyncio.run(_exits_seen(watch, 0.3, 3 * exit_watch.POLL_S + 0.2, stop_first=False))
    assert len(after) == 1
    assert after[0] < 2 * exit_watch.POLL_S + 0.1  # a poll's interval at most (and a scheduler's)


def test_a_stopped_watch_calls_nothing(watch: ExitWatch) -> None:
    after = asyncio.run(_exits_seen(watch, 0.1, 3 * exit_watch.POLL_S + 0.2, stop_first=True))
    assert after == []
    watch.stop()  # a second stop does nothing


def test_a_kernel_that_refuses_pidfd_open_means_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")  # Linux before 5.3

    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    assert open_pidfd(os.getpid()) is None
