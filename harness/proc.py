"""One process a test or benchmark runs (a worker, a gateway): started in its own process group,
its log in a file, waited on until healthy, stopped by signal; and its memory, from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.lifetime import parent_death_launcher
from harness.ports import HOST


@dataclass(slots=True)
class Proc:
    name: str
    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen | None = None
    extra: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    # SIGTERM when the process that started it ends, even by SIGKILL (harness/lifetime.py).
    # None: when started from the main thread, which ends only with that process.
    die_with_parent: bool | None = None
    executable: str | None = None  # the interpreter (None: this one); vLLM has a venv of its own

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.alive() and self.popen is not None else None

    def start(self) -> None:
        log = self.log_path.open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        # A new session, so stopping the cluster also stops anything the process started.
        launcher = parent_death_launcher(self.die_with_parent)
        self.popen = subprocess.Popen(
            [*launcher, self.executable or sys.executable, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a refused connect costs next to nothing; a worker starts in ~1 s
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGTERM, wait: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process from /proc (Linux), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None
