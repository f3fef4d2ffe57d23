"""Reading a fleet and its gateways while `bench.fleet_scale` runs: CPU time and memory from
/proc, the gateways' metrics, readiness, cache resets, and whether every gateway's index equals
the replicas' caches (at a quiet point, with nothing in flight)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.lib.proc_stats import cpu_seconds
from harness.proc import Proc, rss_bytes
from harness.prom import Scrape, combined
from harness.waits import snapshot_digest

SETTLE_S = 2.5  # speculative entries (2 s) expire after a reset


@dataclass(slots=True)
class Reading:
    """The gateways and the fleet at one moment."""

    at: float
    gateway_cpu: list[float]  # per gateway, seconds
    ingest_cpu: list[float]  # per gateway, its ingestion thread's seconds (its own metric)
    fleet_cpu: float
    rss: list[int]  # per gateway, bytes
    metrics: Scrape  # every gateway's /metrics, added

    def cpu_since(self, before: Reading) -> float:
        return sum(self.gateway_cpu) - sum(before.gateway_cpu)


def read(client: httpx.Client, gateways: Sequence[Proc], fleet_pid: int) -> Reading:
    pids = [g.pid for g in gateways]
    if None in pids:
        raise RuntimeError("a gateway exited:\n" + "\n".join(g.log_tail(20) for g in gateways))
    pages = [Scrape.parse(client.get(f"{g.url}/metrics", timeout=60).text) for g in gateways]
    return Reading(
        at=time.monotonic(),
        gateway_cpu=[cpu_seconds(p) for p in pids],
        ingest_cpu=[page.total("kvgate_event_ingest_cpu_seconds_total") for page in pages],
        fleet_cpu=cpu_seconds(fleet_pid),
        rss=[rss_bytes(p) or 0 for p in pids],
        metrics=combined(pages),
    )


def _index(client: httpx.Client, gateway: str) -> dict:
    return client.get(f"{gateway}/kvgate/index", timeout=120).json()


def wait_ready(client: httpx.Client, gateways: Sequence[Proc], n: int, timeout: float) -> float:
    """Until every gateway has all `n` replicas healthy with their events synced; the seconds
    it took (TimeoutError with each gateway's counts otherwise). Prints progress."""
    t0 = time.monotonic()
    last = t0
    while True:
        counts = []
        for g in gateways:
            reps = _index(client, g.url)["replicas"].values()
            counts.append(
                (sum(r["healthy"] for r in reps), sum(r["synced"] and r["healthy"] for r in reps))
            )
        if all(h == s == n for h, s in counts):
            return time.monotonic() - t0
        now = time.monotonic()
        if now - t0 > timeout:
            raise TimeoutError(f"gateways not ready in {timeout:.0f}s: (healthy, synced) {counts}")
        if now - last >= 5:
            print(f"  waiting for the gateways: (healthy, synced) of {n}: {counts}", flush=True)
            last = now
        time.sleep(0.5)


def reset_caches(client: httpx.Client, urls: Sequence[str], gateways: Sequence[Proc]) -> None:
    """Empty every replica's cache and wait until every gateway's index is empty too."""
    for url in urls:
        if not client.post(f"{url}/reset_prefix_cache", timeout=30).json().get("reset"):
            raise RuntimeError(f"{url} refused to reset its cache (requests still in flight?)")
    deadline = time.monotonic() + 120
    while any(_index(client, g.url)["blocks"] for g in gateways):
        if time.monotonic() > deadline:
            raise TimeoutError("the gateways' indexes did not empty after the reset")
        time.sleep(0.5)
    time.sleep(SETTLE_S)


def fleet_digests(client: httpx.Client, urls: Sequence[str]) -> dict[str, tuple[str, int]]:
    return {url: snapshot_digest(url, client=client) for url in urls}


def index_differences(
    client: httpx.Client, gateways: Sequence[Proc], urls: Sequence[str]
) -> dict[str, int]:
    """Per gateway, how many replicas' index entries differ from their caches right now."""
    caches = fleet_digests(client, urls)
    out = {}
    for g in gateways:
        reps = _index(client, g.url)["replicas"]
        out[g.url] = sum(
            (reps.get(u) or {}).get("digest") != d or reps[u]["blocks"] != n
            for u, (d, n) in caches.items()
        )
    return out


def wait_indexes_equal(
    client: httpx.Client, gateways: Sequence[Proc], urls: Sequence[str], timeout: float
) -> tuple[bool, float, dict[str, int]]:
    """At a quiet point: until every gateway's index equals every replica's cache. Returns
    whether it did, the seconds it took, and the last differences per gateway."""
    t0 = time.monotonic()
    while True:
        diff = index_differences(client, gateways, urls)
        if not any(diff.values()) or time.monotonic() - t0 > timeout:
            return not any(diff.values()), time.monotonic() - t0, diff
        time.sleep(0.5)
