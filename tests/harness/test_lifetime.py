"""The harness's process lifetimes, with real processes: a bench's, test's or `make demo`'s
cluster dies with it even when it is killed with SIGKILL, unwinds when it is sent SIGTERM, and
each demo run writes its own logs, which no later run touches while it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.lifetime import unwind_on_termination
from harness.run_logs import claim_log_dir, running_runs
from tests.support.paths import REPO
from tests.support.processes import alive, children, wait_dead

# A parent with a thread of its own running (as a bench's load generator would be) that starts a
# harness Proc (a sleeping Python), bound or not (argv[2]: 1, 0 or the default), from its main
# thread or from another (argv[3]), and waits to be killed.
PARENT = """
import sys, threading, time
from pathlib import Path
from harness.proc import Proc
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
bound = {"1": True, "0": False, "default": None}[sys.argv[2]]
p = Proc("child", ["-c", "import time; time.sleep(120)"], 0, Path(sys.argv[1]),
         die_with_parent=bound)
if sys.argv[3] == "main":
    p.start()
else:
    t = threading.Thread(target=p.start)
    t.start()
    t.join()
print(p.popen.pid, flush=True)
time.sleep(120)
"""

# A bench: one sim worker in a `with Cluster`, waiting to be stopped by a signal. Started as
# from a terminal (SIGHUP at its default, whatever this test inherited: a suite run under
# `nohup` ignores it, and so would its benches), or under nohup (argv[3]).
BENCH = """
import signal, sys, time
from pathlib import Path
from harness.cluster import Cluster, ClusterSpec
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[3] == "nohup" else signal.SIG_DFL)
spec = ClusterSpec(workers=1, gateways=0, engine="sim", model=sys.argv[1],
                   log_dir=Path(sys.argv[2]))
with Cluster(spec) as c:
    print(c.workers[0].popen.pid, flush=True)
    time.sleep(120)
"""

# A run that claims a log directory, says which, writes to it and waits to be killed.
RUN = """
import sys, time
from pathlib import Path
from harness.run_logs import claim_log_dir
run = claim_log_dir(Path(sys.argv[1]), keep=1)
(run / "worker-0.log").write_text("kept run's log\\n")
print(run, flush=True)
time.sleep(120)
"""


def spawn(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def kill9(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


@pytest.mark.parametrize(
    ("bound", "thread", "dies"),
    [
        ("1", "main", True),
        ("default", "main", True),  # every bench's and test's cluster, started from main
        ("0", "main", False),  # what `make demo` did before: the test can fail
        # Bound by default only from the main thread: the kernel signals the child when the
        # thread that started it ends, and this one ended at once.
        ("default", "other", False),
    ],
)
def test_processes_die_with_a_sigkilled_parent(
    tmp_path: Path, bound: str, thread: str, dies: bool
) -> None:
    parent, pid = spawn(PARENT, str(tmp_path / "child.log"), bound, thread)
    child = int(pid)
    try:
        assert alive(child)
        kill9(parent)
        if dies:
            assert wait_dead(child, 10), "a bound child outlived its SIGKILLed parent"
        else:
            assert not wait_dead(child, 1), "an unbound child died with its parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_sigkilled_bench_takes_its_cluster_with_it(tmp_path: Path, demo_model_dir: Path) -> None:
    """A bench killed with SIGKILL (an OOM kill, a CI runner's hard timeout) runs no `finally`:
    its worker and the worker's engine core go anyway, as they would hold a GPU's memory."""
    bench, pid = spawn(BENCH, str(demo_model_dir), str(tmp_path / "logs"), "terminal")
    worker = int(pid)
    (core,) = children(worker)
    try:
        kill9(bench)
        assert wait_dead(worker, 10), "the worker outlived a SIGKILLed bench"
        assert wait_dead(core, 10), "the worker's engine core outlived it"
    finally:
        for p in (worker, core):
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_bench_sent_sigterm_or_sighup_stops_its_cluster(
    tmp_path: Path, demo_model_dir: Path, sig: signal.Signals
) -> None:
    bench, pid = spawn(BENCH, str(demo_model_dir), str(tmp_path / "logs"), "terminal")
    worker = int(pid)
    (core,) = children(worker)  # its engine core process
    try:
        bench.send_signal(sig)
        assert bench.wait(30) != 0  # it unwound: the with block stopped the cluster, then ended
        assert wait_dead(worker, 10), f"the worker outlived a bench sent {sig.name}"
        assert wait_dead(core, 10), "the worker's engine core outlived it"
    finally:
        for p in (worker, core):
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()


def test_a_bench_under_nohup_outlives_a_hangup_and_stops_on_sigterm(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """An ignored SIGHUP is someone else's choice (nohup's): the bench keeps it, and its
    cluster runs on; SIGTERM still stops both."""
    bench, pid = spawn(BENCH, str(demo_model_dir), str(tmp_path / "logs"), "nohup")
    worker = int(pid)
    try:
        bench.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            bench.wait(2)
        assert alive(worker)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) != 0
        assert wait_dead(worker, 10), "the worker outlived a bench sent SIGTERM"
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()


def test_unwinding_is_on_only_within_its_block_and_leaves_others_handlers_alone() -> None:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with unwind_on_termination(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # let the handler run here, not in a later line
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGHUP, own)
    try:
        with unwind_on_termination():
            assert signal.getsignal(signal.SIGHUP) is own
        assert signal.getsignal(signal.SIGHUP) is own
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_each_run_keeps_its_own_logs_while_it_runs(tmp_path: Path) -> None:
    base = tmp_path / "demo-logs"
    first, first_dir = spawn(RUN, str(base))
    second, second_dir = spawn(RUN, str(base))
    try:
        assert first_dir != second_dir
        # keep=1 in each run: a live run's directory is never pruned, nor its log touched.
        assert Path(first_dir, "worker-0.log").read_text() == "kept run's log\n"
        assert running_runs(base) == sorted([Path(first_dir), Path(second_dir)])
        assert (base / "latest").resolve() == Path(second_dir).resolve()
        kill9(second)
        third = claim_log_dir(base, keep=1)  # this test's own process holds it
        assert Path(first_dir).is_dir() and not Path(second_dir).exists()
        assert running_runs(base) == sorted([Path(first_dir), third])
        assert (base / "latest").resolve() == third.resolve()
    finally:
        for p in (first, second):
            if p.poll() is None:
                kill9(p)
