"""Processes that die with their parent, even when the parent is killed with SIGKILL.

Linux's parent-death signal (prctl PR_SET_PDEATHSIG): the kernel sends the child a signal when
the thread that started it exits, however it exits. A child started from a thread that ends
before the child should would be signalled then, so only main-thread owners opt in (`make demo`).
Elsewhere (macOS) these do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets `sig` when this process (this thread) ends."""
    parent = os.getpid()

    def arm() -> None:
        _set_parent_death_signal(sig)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), sig)

    return arm


def bind_to_parent(sig: int = signal.SIGTERM) -> None:
    """This process gets `sig` when its parent (e.g. `make`) ends, so its own cleanup runs."""
    parent = os.getppid()
    if parent != 1 and _set_parent_death_signal(sig) and os.getppid() != parent:
        os.kill(os.getpid(), sig)
