"""Worker discovery: a source of the full current set of workers (`WorkerEndpoint`s).

`static.StaticDiscovery` serves `--workers`; `k8s.KubernetesDiscovery` watches EndpointSlices.
Both implement `Discovery`: `run(on_change)` calls `on_change(workers)` with the whole set every
time it changes (at least once), and runs until cancelled.

`peer_pods.PeerPodDiscovery` finds the other gateways the same way (their pods, by a label), for
the peer link (gateway/peers/link.py, `--peers-from-kubernetes`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.discovery.endpoints import WorkerEndpoint

OnChange = Callable[[frozenset[WorkerEndpoint]], Awaitable[None]]


class Discovery(Protocol):
    async def run(self, on_change: OnChange) -> None: ...


__all__ = ["Discovery", "OnChange"]
