"""A replica's names: its id (`ReplicaId`, what the index and routing key it by: its worker URL,
with `#dp<r>` for data-parallel rank r > 0), and the name a client sees for the replica that
served it (`x-kvgate-replica`): never its URL.

A worker's URL tells a client the cluster's internal addresses. The name is a short keyed hash
of the replica id: stable (every gateway replica computes the same name for the same worker,
so a session can be followed across them) and, keyed by the worker token, not something a
client can compute from a guessed address. `/kvgate/index` (an admin endpoint) maps names back
to URLs for operators. Without a worker token the hash is unkeyed: a client that guesses a
worker's URL can confirm the guess (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NewType

ReplicaId = NewType("ReplicaId", str)


def replica_name(replica_id: str, worker_token: str | None) -> str:
    key = (worker_token or "").encode()
    digest = hmac.new(key, b"kvgate replica name\0" + replica_id.encode(), hashlib.sha256)
    return "w-" + digest.hexdigest()[:12]


# The instance id of every plain vLLM worker (gateway/fleet/vllm_compat.py gives it them): the
# event transport follows those in connect mode (gateway/events/followers.py).
VLLM_INSTANCE = "vllm"
