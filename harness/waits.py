"""Waiting on a running cluster (soak, fault and end-to-end tests): a condition, and the
gateway's index converging on what every worker's snapshot says it holds."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

import httpx

from cachekey.documents import Snapshot, decode_document


def snapshot_digest(
    worker_url: str, headers: dict[str, str] | None = None, client: httpx.Client | None = None
) -> tuple[str, int]:
    """(digest, blocks) of a worker's `/kv/snapshot`, computed like the gateway's index digest.

    kvgate workers key blocks exactly as the gateway does, so equal digests mean the gateway's
    index holds exactly the worker's cached blocks. A replica id `URL#dp<r>` (data-parallel rank
    r of a worker) names that rank's snapshot.
    """
    url, _, rank = worker_url.partition("#dp")
    query = f"?rank={rank}" if rank else ""
    resp = (client or httpx).get(f"{url}/kv/snapshot{query}", headers=headers, timeout=10)
    snap = decode_document(resp.content, Snapshot)
    keys = sorted({bytes.fromhex(b.key) for b in snap.blocks})
    h = hashlib.sha256()
    for key in keys:
        h.update(key)
    return h.hexdigest(), len(keys)


def index_mismatches(
    gateway_url: str,
    worker_urls: Sequence[str],
    headers: dict[str, str] | None = None,
    client: httpx.Client | None = None,
) -> dict[str, str]:
    """Workers whose gateway index entry differs from their snapshot (empty: converged).
    `client` keeps its connections between calls (httpx.get makes a new client each time)."""
    http = client or httpx
    replicas = http.get(f"{gateway_url}/kvgate/index", timeout=10).json()["replicas"]
    bad: dict[str, str] = {}
    for url in worker_urls:
        digest, blocks = snapshot_digest(url, headers, client)
        entry = replicas.get(url)
        if entry is None:
            bad[url] = "not in the gateway's index"
        elif entry["digest"] != digest or entry["blocks"] != blocks:
            bad[url] = f"gateway {entry['blocks']} blocks vs worker {blocks}"
    return bad


def wait_index_converged(
    gateway_url: str,
    worker_urls: Sequence[str],
    timeout: float = 15.0,
    headers: dict[str, str] | None = None,
) -> None:
    """Poll until the gateway's index equals every worker's snapshot; raise with the diff.
    `headers`: for workers that want their token."""
    deadline = time.monotonic() + timeout
    while True:
        bad = index_mismatches(gateway_url, worker_urls, headers)
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway index did not converge: {bad}")
        time.sleep(0.2)


def wait_until(cond: Callable[[], bool], timeout: float, what: str = "condition") -> float:
    """Poll `cond` every 0.1 s; returns the seconds it took, raises AssertionError on timeout."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start
