"""ExitWatch: tell the API server's event loop that an engine core process has exited.

On Linux 5.3 and later a pidfd (os.pidfd_open) becomes readable the moment the process exits,
however it died, and the loop watches it like a socket. Where there is none (macOS, whose
Python has no os.pidfd_open; an older kernel, such as RHEL 8's 4.18; a container whose seccomp
profile refuses the call) the loop polls the process every `POLL_S` instead: the same callback,
at most that much later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_S = 0.1


def open_pidfd(pid: int) -> int | None:
    """A pidfd for `pid`, or None where the platform or the kernel has none."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(pid)
    except OSError as e:  # ENOSYS before Linux 5.3, EPERM under a seccomp filter
        logger.info("no pidfd for the engine core (%s): its exit is polled every %ss", e, POLL_S)
        return None


class ExitWatch:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pidfd = open_pidfd(proc.pid)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        """Call `on_exit` once, on `loop`, when the process has exited."""
        self._loop = loop
        if self.pidfd is not None:
            loop.add_reader(self.pidfd, self._fire, on_exit)  # readable from the exit on
        else:
            self._poll(on_exit)

    def _poll(self, on_exit: Callable[[], None]) -> None:
        if self.proc.poll() is not None:
            self._fire(on_exit)
            return
        assert self._loop is not None
        self._timer = self._loop.call_later(POLL_S, self._poll, on_exit)

    def _fire(self, on_exit: Callable[[], None]) -> None:
        self.stop()
        on_exit()

    def stop(self) -> None:
        """Stop watching (a second call, or one before `start`, does nothing)."""
        if self._loop is None:
            return
        if self.pidfd is not None:
            self._loop.remove_reader(self.pidfd)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None

    def close(self) -> None:
        """Close the pidfd (after `stop`, on the loop's thread: this may run on another)."""
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
