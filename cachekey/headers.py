"""Every `x-*` header name kvgate reads or writes, once (tests/project/test_header_names.py).

Lower case, as HTTP/2 and Envoy require and as Starlette looks them up (case-insensitively).
"""

from __future__ import annotations

# ---- gateway -> worker ---------------------------------------------------------------------

# The gateway's hint to the worker it sends a request to: the key, in hex, of the last block it
# predicts the request to hit (cachekey.keys.parse_prefix_header). The worker keeps that chain
# cached from the moment the request arrives (worker/engine/block_manager.py, refresh_chain),
# not only once it is rendered.
PREFIX_HEADER = "x-kvgate-prefix"
# vLLM's choice of one data-parallel engine behind a server: its index (vLLM spells it
# `X-data-parallel-rank`; header names are case-insensitive).
RANK_HEADER = "x-data-parallel-rank"

# ---- client <-> gateway --------------------------------------------------------------------

POLICY_HEADER = "x-kvgate-routing-policy"  # a request's choice of routing policy
SESSION_HEADER = "x-session-id"  # the default header the session policy hashes
REPLICA_HEADER = "x-kvgate-replica"  # the replica that served a response
PREDICTED_HEADER = "x-kvgate-predicted-cached-tokens"  # the cached tokens the gateway predicted
# ... of which the worker's GPU holds, and its host-memory tier (`medium: "CPU"`) holds
PREDICTED_GPU_HEADER = "x-kvgate-predicted-gpu-cached-tokens"
PREDICTED_CPU_HEADER = "x-kvgate-predicted-cpu-cached-tokens"

# ---- proxy <-> endpoint picker (Gateway API inference extension; gateway/epp/wire.py) -----

DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
