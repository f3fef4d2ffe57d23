"""GatewayConfig's checks: run once, when it is built (flags, Helm values and tests alike).

A bad value raises ValueError naming the flag's field, so `python -m gateway` fails at start
with that message instead of later on the request path."""

from __future__ import annotations

from typing import Any

from cachekey.worker_auth import resolve_token
from gateway.discovery.endpoints import check_topic, parse_bind, parse_worker
from gateway.images.guard import AllowList
from kvgate_cli.flags import LOG_LEVELS

# The checks take a GatewayConfig (config.py calls them from its __post_init__, so this module
# cannot import it back).
GatewayConfig = Any

POLICY_NAMES = ("cache_aware", "round_robin", "least_loaded", "session", "random")
DISCOVERY_NAMES = ("static", "k8s", "inferencepool")


def check_config(c: GatewayConfig) -> None:
    _check_discovery(c)
    _check_endpoints(c)
    _check_routing(c)
    _check_inputs(c)


def _check_discovery(c: GatewayConfig) -> None:
    c.workers = tuple(w.strip().rstrip("/") for w in c.workers if w.strip())
    if c.policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {c.policy!r}; choose from {POLICY_NAMES}")
    if c.discovery not in DISCOVERY_NAMES:
        raise ValueError(f"discovery must be one of {', '.join(DISCOVERY_NAMES)}")
    if c.discovery == "k8s" and not c.k8s_namespace:
        raise ValueError("Kubernetes discovery needs --k8s-namespace")
    if c.discovery == "inferencepool" and not c.k8s_namespace:
        raise ValueError("InferencePool discovery needs --k8s-namespace")
    if c.discovery == "inferencepool" and not c.inference_pool:
        raise ValueError("inferencepool discovery needs --inference-pool")
    if c.discovery == "static":
        urls = [parse_worker(w).url for w in c.workers]  # raises on a malformed one
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"worker listed twice: {', '.join(twice)}")


def _check_peers(c: GatewayConfig) -> None:
    c.peers = tuple(p.strip() for p in c.peers if p.strip())
    if c.peers and c.peer_port is None:
        raise ValueError("--peers needs --peer-port (where this gateway publishes to them)")
    if c.peers_from_kubernetes is not None and c.peer_port is None:
        raise ValueError("--peers-from-kubernetes needs --peer-port (the port every peer uses)")
    if c.peers_from_kubernetes is not None and not c.peers_from_kubernetes.strip():
        raise ValueError("--peers-from-kubernetes needs a label selector")
    if c.peer_port is not None and not 0 < c.peer_port < 65536:
        raise ValueError(f"peer port out of range: {c.peer_port}")
    for p in c.peers:
        host, _, port = p.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a peer is HOST:PORT, got {p!r}")
    if c.peer_timeout <= 0:
        raise ValueError("--peer-timeout must be positive")


def _check_endpoints(c: GatewayConfig) -> None:
    check_topic(c.vllm_kv_events_topic)
    if c.kv_events_bind is not None:
        parse_bind(c.kv_events_bind)  # raises on anything but tcp://HOST:PORT
    if not 0 < c.port < 65536:
        raise ValueError(f"port out of range: {c.port}")
    if c.admin_port is not None:
        if not 0 < c.admin_port < 65536:
            raise ValueError(f"admin port out of range: {c.admin_port}")
        if c.admin_port == c.port or (c.epp and c.admin_port == c.epp_port):
            raise ValueError("--admin-port must differ from --port and --epp-port")
    c.worker_token = resolve_token(c.worker_token)
    _check_peers(c)
    if not 0 < c.epp_port < 65536 or (c.epp and c.epp_port == c.port):
        raise ValueError(f"epp_port out of range or equal to port: {c.epp_port}")
    if (c.epp_tls_cert_file is None) != (c.epp_tls_key_file is None):
        raise ValueError("--epp-tls-cert-file and --epp-tls-key-file go together")


def _check_routing(c: GatewayConfig) -> None:
    if c.index_max_blocks <= 0:
        raise ValueError("index_max_blocks must be positive")
    if c.speculative_ttl is None:
        c.speculative_ttl = 2.0 if c.kv_events else 120.0
    if c.speculative_ttl < 0 or c.retries < 0 or c.epp_fallbacks < 0:
        raise ValueError("speculative_ttl, retries and epp_fallbacks must be >= 0")
    if c.connect_timeout <= 0 or c.request_timeout <= 0 or c.poll_interval <= 0:
        raise ValueError("timeouts and poll_interval must be positive")
    if c.down_after_failed_polls < 1:
        raise ValueError("down_after_failed_polls must be >= 1")
    if c.event_tail_check_interval <= 0:
        raise ValueError("event_tail_check_interval must be positive")
    for rate in (c.max_polls_per_second, c.max_tail_checks_per_second):
        if rate is not None and rate <= 0:
            raise ValueError("max_polls_per_second and max_tail_checks_per_second must be > 0")
    if c.recent_half_life <= 0:
        raise ValueError("recent_half_life must be positive")
    if c.softmax_temperature < 0:
        raise ValueError("softmax_temperature must be >= 0")


def _check_inputs(c: GatewayConfig) -> None:
    c.image_fetch_allow = tuple(c.image_fetch_allow)
    AllowList.parse(c.image_fetch_allow)  # raises on a malformed entry
    if c.image_fetch_timeout <= 0 or c.image_fetch_max_bytes <= 0:
        raise ValueError("image_fetch_timeout and image_fetch_max_bytes must be positive")
    if c.max_inflight_per_replica is not None and c.max_inflight_per_replica <= 0:
        raise ValueError("max_inflight_per_replica must be positive")
    if c.max_queue < 0 or c.queue_timeout < 0:
        raise ValueError("max_queue and queue_timeout must be >= 0")
    if c.log_level not in LOG_LEVELS or c.log_level_http not in LOG_LEVELS:
        raise ValueError(f"log levels must be one of {', '.join(LOG_LEVELS)}")
    if c.drain_timeout < 0:
        raise ValueError("drain_timeout must be >= 0")
    if c.start_wait < 0:
        raise ValueError("start_wait must be >= 0")
    if c.max_render_queue <= 0:
        raise ValueError("max_render_queue must be positive")
