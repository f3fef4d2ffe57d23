"""Processes that die with their parent.

SIGTERM or SIGHUP (a `timeout`, a `kill`, a closed terminal, a cancelled CI job) would end a
bench or test run at once, leaving the cluster it started running: its workers and gateways are
in sessions of their own. `unwind_on_termination` (every Cluster, from the main thread) makes
them unwind like Ctrl-C instead, so the `with` block stops the cluster.

A SIGKILL skips all that (an OOM kill, `kill -9`, a CI runner's hard timeout), and a GPU worker
left behind holds its GPU's memory. Linux's parent-death signal (prctl PR_SET_PDEATHSIG) covers
it: the kernel signals the child when the thread that started it exits, however it exits.
Arming it in a `preexec_fn` runs Python between fork and exec, which is unsafe in a process
with threads (most benches and every test session have some), so `parent_death_launcher`
arms it in the child after exec instead: a tiny interpreter that calls prctl, checks that its
parent is still the one that started it, and execs the real program (the signal survives
exec). Because the kernel ties it to the starting thread, only processes started from the main
thread are bound by default (`Proc.die_with_parent`); one started from a thread that ends
first would be signalled then. Elsewhere (macOS) none of this does anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


# Run as `python -I -S -c _ARM_AND_EXEC <parent pid> <signal> <program> <args...>`: nothing but
# the standard library, no site packages, so it adds milliseconds to a process's start.
_ARM_AND_EXEC = """
import ctypes, os, sys
parent, sig, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(f"parent {parent} ended before {argv[0]} started")
os.execv(argv[0], argv)
"""


def parent_death_launcher(bind: bool | None = None, sig: int = signal.SIGTERM) -> list[str]:
    """The argv prefix that starts a program bound to this process (to this thread): the
    program gets `sig` when it ends, even by SIGKILL. `bind` None: bound when started from the
    main thread, which ends only with the process. Empty when unbound, or where Linux's prctl
    is not."""
    if bind is None:
        bind = threading.current_thread() is threading.main_thread()
    if not bind or not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-I", "-S", "-c", _ARM_AND_EXEC, str(os.getpid()), str(int(sig))]


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
