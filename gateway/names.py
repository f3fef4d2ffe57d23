"""A replica's names: its id (`ReplicaId`, what the index and routing key it by: its worker URL,
with `#dp<r>` for data-parallel rank r > 0), and its name: the one name clients
(`x-kvgate-replica`, 503 messages), metrics (the `replica` label) and logs use. Never its URL.

Where the platform names the worker, the name is that: its Kubernetes pod (from discovery), a
StatefulSet pod keeping its name (`kvgate-worker-0`) across restarts while its IP, and so its URL,
changes; so its metric series go on. Elsewhere (static `--workers`, whose URLs are the stable
part) it is a short keyed hash of the replica id: stable (every gateway replica computes the same
name for the same worker, so a session can be followed across them) and, keyed by the worker
token, not something a client can compute from a guessed address. Without a worker token the hash
is unkeyed: a client that guesses a worker's URL can confirm the guess (docs/security.md). The
URL stays one label, for joins: `kvgate_replica_info{replica, url}`, and `/kvgate/index` (both
admin endpoints).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NewType

ReplicaId = NewType("ReplicaId", str)


def replica_name(replica_id: str, worker_token: str | None, pod: str | None = None) -> str:
    """The replica's name: its pod's (`pod#dp<r>` for a rank r > 0), else the keyed hash."""
    if pod:
        _, sep, rank = replica_id.rpartition("#dp")
        return f"{pod}#dp{rank}" if sep and rank.isdigit() else pod
    key = (worker_token or "").encode()
    digest = hmac.new(key, b"kvgate replica name\0" + replica_id.encode(), hashlib.sha256)
    return "w-" + digest.hexdigest()[:12]


# The instance id of every plain vLLM worker (gateway/fleet/vllm_compat.py gives it them): the
# event transport follows those in connect mode (gateway/events/followers.py).
VLLM_INSTANCE = "vllm"
