"""GatewayConfig: every knob of the gateway, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.image_fetch import AllowList
from gateway.limits import RequestLimits

POLICY_NAMES = ("cache_aware", "round_robin", "least_loaded", "session", "random")


@dataclass(slots=True)
class CostWeights:
    """Weights of the cache_aware cost (see docs/gateway.md)."""

    prefill: float = 1.0  # per uncached prompt block
    load: float = 1.0  # per in-flight uncached prefill block + decode_weight per in-flight request
    decode: float = 2.0  # blocks-equivalent cost of one in-flight request's decode
    queue: float = 4.0  # per request waiting in the worker's queue
    kv: float = 8.0  # times the worker's KV usage (0..1)
    recent: float = 0.05  # per block of uncached prefill routed to the replica lately (decayed)

    def __post_init__(self) -> None:
        for name in ("prefill", "load", "decode", "queue", "kv", "recent"):
            if getattr(self, name) < 0:
                raise ValueError(f"weight {name} must be >= 0")


@dataclass(slots=True)
class GatewayConfig:
    workers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "cache_aware"
    model_dir: str | None = None
    index_max_blocks: int = 1_000_000
    speculative_ttl: float = 2.0
    retries: int = 2
    connect_timeout: float = 2.0
    request_timeout: float = 600.0
    poll_interval: float = 0.5  # worker /health, /kvgate/info and /metrics polling
    eject_after_failures: int = 3
    eject_seconds: float = 10.0
    weights: CostWeights = field(default_factory=CostWeights)
    recent_half_life: float = 60.0  # seconds; decay of the recent-prefill term
    softmax_temperature: float = 0.0  # 0: pick the lowest cost; > 0: sample softmax(-cost/T)
    session_header: str = "x-session-id"
    # Front door (docs/security.md): input limits, image fetching, tenants, overload.
    limits: RequestLimits = field(default_factory=RequestLimits)
    image_fetch_timeout: float = 10.0  # all remote images of one request together
    image_fetch_max_bytes: int = 32 * 2**20  # all remote images of one request together
    image_fetch_allow: tuple[str, ...] = ()  # host names and CIDRs exempt from the SSRF guard
    remote_images: bool = True
    allow_image_uuids: bool = False  # a client's image `uuid` counts (scoped to its tenant)
    api_keys_file: str | None = None
    tenant_salt_secret: str | None = None  # else env KVGATE_TENANT_SALT_SECRET, else the file
    max_inflight_per_replica: int | None = 256
    max_queue: int = 1024
    queue_timeout: float = 30.0
    # Plain vLLM workers (no /kvgate/info): where their --kv-events-config publishes.
    vllm_kv_events_port: int | None = None
    vllm_kv_events_replay_port: int | None = None
    vllm_kv_events_topic: str = ""
    discovery: str = "static"  # "static" (--workers) or "k8s"
    k8s_namespace: str | None = None
    k8s_selector: str | None = None
    k8s_service: str | None = None
    k8s_port_name: str = "http"

    def __post_init__(self) -> None:
        self.workers = tuple(w.rstrip("/") for w in self.workers if w.strip())
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICY_NAMES}")
        if self.discovery not in ("static", "k8s"):
            raise ValueError("discovery must be 'static' or 'k8s'")
        if self.discovery == "k8s" and not self.k8s_namespace:
            raise ValueError("Kubernetes discovery needs --k8s-namespace")
        if self.discovery == "static":
            for w in self.workers:
                if not w.startswith(("http://", "https://")):
                    raise ValueError(f"worker URL must start with http:// or https://: {w!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.index_max_blocks <= 0:
            raise ValueError("index_max_blocks must be positive")
        if self.speculative_ttl < 0 or self.retries < 0:
            raise ValueError("speculative_ttl and retries must be >= 0")
        if self.connect_timeout <= 0 or self.request_timeout <= 0 or self.poll_interval <= 0:
            raise ValueError("timeouts and poll_interval must be positive")
        if self.recent_half_life <= 0:
            raise ValueError("recent_half_life must be positive")
        if self.softmax_temperature < 0:
            raise ValueError("softmax_temperature must be >= 0")
        self.image_fetch_allow = tuple(self.image_fetch_allow)
        AllowList.parse(self.image_fetch_allow)  # raises on a malformed entry
        if self.image_fetch_timeout <= 0 or self.image_fetch_max_bytes <= 0:
            raise ValueError("image_fetch_timeout and image_fetch_max_bytes must be positive")
        if self.max_inflight_per_replica is not None and self.max_inflight_per_replica <= 0:
            raise ValueError("max_inflight_per_replica must be positive")
        if self.max_queue < 0 or self.queue_timeout < 0:
            raise ValueError("max_queue and queue_timeout must be >= 0")
