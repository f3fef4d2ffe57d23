"""What the workers hold: each worker's `vllm:num_requests_running + num_requests_waiting`,
sampled every few ms from a thread, for the peak per replica (the in-flight cap across peer
gateways: bench/peer_cap.py, tests/gateway/test_peer_share_cap.py).

A request reaches a worker after its gateway took the slot and leaves it before the slot is
freed, so what a worker holds never exceeds the slots the gateways hold on it.
"""

from __future__ import annotations

import threading
import time

import httpx

from cachekey.worker_auth import bearer
from harness.prom import samples

HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def held(url: str, client: httpx.Client) -> int:
    """Requests a worker holds now: running plus waiting."""
    resp = client.get(f"{url}/metrics", timeout=5)
    resp.raise_for_status()
    return int(sum(v for name, _labels, v in samples(resp.text) if name in HELD))


class LoadSampler(threading.Thread):
    """`with LoadSampler(urls, token) as s: ...; s.peak` (the most any worker held)."""

    def __init__(self, workers: list[str], token: str | None, every: float = 0.005) -> None:
        super().__init__(daemon=True, name="worker-load-sampler")
        self.workers, self.every = workers, every
        self.headers = {"authorization": bearer(token)} if token else {}
        self.peaks = dict.fromkeys(workers, 0)
        self.counts: list[int] = []
        self._stop_event = threading.Event()

    @property
    def peak(self) -> int:
        return max(self.peaks.values())

    def run(self) -> None:
        with httpx.Client(headers=self.headers) as client:
            while not self._stop_event.is_set():
                for w in self.workers:
                    n = held(w, client)
                    self.peaks[w] = max(self.peaks[w], n)
                    self.counts.append(n)
                time.sleep(self.every)

    def __enter__(self) -> LoadSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_event.set()
        self.join()
