"""Running the fleet as a process of its own, with real gateway processes in front of it.

`FleetCluster` is a `Cluster` whose workers are one `python -m harness.fleet` process: tests and
`bench.fleet_scale` start it with `with FleetCluster(spec, fleet) as c:` and read `c.worker_urls`,
`c.gateways` and `c.fleet.pid` as they would a cluster of worker processes.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.cluster import Cluster, ClusterSpec
from harness.fleet.engine import Timing
from harness.proc import Proc


@dataclass(frozen=True, slots=True)
class FleetSpec:
    replicas: int
    num_blocks: int
    timing: Timing = field(default_factory=Timing)
    startup_timeout: float = 120.0

    def args(self, manifest: Path) -> list[str]:
        t = self.timing
        return [
            "-m",
            "harness.fleet",
            "--replicas",
            str(self.replicas),
            "--num-blocks",
            str(self.num_blocks),
            "--prefill-s-per-token",
            str(t.prefill_s_per_token),
            "--decode-s-per-step",
            str(t.decode_s_per_step),
            "--step-s",
            str(t.step_s),
            "--manifest",
            str(manifest),
        ]


@dataclass(slots=True)
class FleetProc:
    """The fleet process, and its replica URLs once its manifest is written."""

    proc: Proc
    manifest: Path
    urls: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, spec: FleetSpec, log_dir: Path) -> FleetProc:
        manifest = log_dir / "fleet.json"
        manifest.unlink(missing_ok=True)
        log = log_dir / "fleet.log"
        log.write_bytes(b"")
        return cls(Proc("fleet", spec.args(manifest), 0, log), manifest)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def start(self, timeout: float) -> list[str]:
        """Start it and wait until every replica listens; its URLs."""
        self.proc.start()
        deadline = time.monotonic() + timeout
        while not self.manifest.exists():
            if not self.proc.alive():
                raise RuntimeError(f"the fleet exited early:\n{self.proc.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fleet not ready after {timeout:.0f}s:\n{self.proc.log_tail()}")
            time.sleep(0.1)
        self.urls = json.loads(self.manifest.read_text())["urls"]
        return self.urls

    def kill(self) -> None:
        self.proc.kill()


class FleetCluster(Cluster):
    """A fleet process and `spec.gateways` gateway processes routing to its replicas."""

    def __init__(self, spec: ClusterSpec, fleet: FleetSpec) -> None:
        super().__init__(spec)
        self.fleet_spec = fleet
        self.fleet: FleetProc | None = None

    @property
    def worker_urls(self) -> list[str]:
        return self.fleet.urls if self.fleet is not None else []

    def start(self) -> FleetCluster:
        try:
            self.fleet = FleetProc.create(self.fleet_spec, self.spec.log_dir)
            self.fleet.start(self.fleet_spec.startup_timeout)
            self.start_gateways()
        except BaseException:
            self.stop()
            raise
        return self

    def start_gateways(self, src: Path | None = None) -> None:
        """`spec.gateways` gateways (after any running ones are stopped); `src`: import
        `gateway` from that checkout instead of this one (a baseline to compare with)."""
        self.stop_gateways()
        self.gateways = [self.make_gateway(i) for i in range(self.spec.gateways)]
        for g in self.gateways:
            g.log_path = g.log_path.resolve()
            # `python -m` puts the working directory first on sys.path.
            with contextlib.chdir(src or Path.cwd()):
                g.start()
        for g in self.gateways:
            g.wait_healthy(self.spec.startup_timeout)

    def stop_gateways(self) -> None:
        for g in self.gateways:
            g.kill()
        self.gateways = []

    def stop(self) -> None:
        self.stop_gateways()
        if self.fleet is not None:
            self.fleet.kill()
