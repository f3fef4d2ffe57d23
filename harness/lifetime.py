"""Processes that die with their parent.

SIGTERM or SIGHUP (a `timeout`, a `kill`, a closed terminal, a cancelled CI job) would end a
bench or test run at once, leaving the cluster it started running: its workers and gateways are
in sessions of their own. `unwind_on_termination` (every Cluster, from the main thread) makes
them unwind like Ctrl-C instead, so the `with` block stops the cluster.

A SIGKILL skips all that. Linux's parent-death signal (prctl PR_SET_PDEATHSIG) covers it: the
kernel sends the child a signal when the thread that started it exits, however it exits. A
child started from a thread that ends before the child should would be signalled then, so only
main-thread owners opt in (`make demo`). Elsewhere (macOS) these do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

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


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def unwind_on_termination() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP raise KeyboardInterrupt where they would have ended this
    process at once (their default), so `finally` and `with` stop what it started; a handler
    someone else set is left alone, and so is an ignored signal (`nohup` ignores SIGHUP: its
    bench runs on after a hangup, as asked). Main thread only (Python runs handlers there);
    elsewhere, and once the block ends, nothing changes: a second signal while it unwinds ends
    it at once. KeyboardInterrupt rather than SystemExit: pytest ends the session on it, where a
    SystemExit would fail one test and go on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mine = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_DFL]
    for sig in mine:
        signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig in mine:
            signal.signal(sig, signal.SIG_DFL)
