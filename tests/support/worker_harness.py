"""Start a real `python -m worker` process on 127.0.0.1 for tests, and stop it.

$KVGATE_TEST_WORKER_ARGS (shell-split) is appended to every worker's flags: a whole suite runs
with an engine option on, e.g. `KVGATE_TEST_WORKER_ARGS=--async-scheduling`."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.lifetime import parent_death_launcher
from harness.ports import free_port
from tests.support.paths import REPO


class WorkerProcess:
    def __init__(
        self,
        model_dir: Path | str,
        *args: str,
        engine: str = "sim",
        events: bool = True,
        env: dict[str, str] | None = None,
    ):
        self.env = env or {}
        self.port = free_port()
        self.events_port = free_port() if events else 0
        self.replay_port = free_port() if events else 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable,
            "-m",
            "worker",
            "--model",
            str(model_dir),
            "--served-model-name",
            "demo",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--engine",
            engine,
            "--kv-events-port",
            str(self.events_port),
            "--kv-events-replay-port",
            str(self.replay_port),
            "--log-level",
            "warning",
            *args,
            *shlex.split(os.environ.get("KVGATE_TEST_WORKER_ARGS", "")),
        ]
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop)
            prefix="kvgate-worker-", suffix=".log", delete=False
        )
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> WorkerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        # Bound to this test run, as harness/proc.py's processes: a SIGKILLed pytest leaves none.
        bind = parent_death_launcher()
        self.proc = subprocess.Popen(
            [*bind, *self.argv], cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"worker not healthy in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
