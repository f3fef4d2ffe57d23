"""GatewayConfig: every knob of the gateway, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachekey.headers import SESSION_HEADER
from gateway.config_checks import DISCOVERY_NAMES, POLICY_NAMES, check_config
from gateway.cost_weights import CostWeights
from gateway.limits import RequestLimits
from kvgate_cli.flags import LOG_LEVELS, flag_group, format_size, option, parse_size


def _unbounded_if_zero(text: str) -> int | None:
    return int(text) or None


def _rate_or_unbounded(text: str) -> float | None:
    return float(text) or None


@dataclass(slots=True)
class GatewayConfig:
    workers: tuple[str, ...] = option(
        (),
        "static worker base URLs, comma-separated or repeated; a plain vLLM worker may add "
        "its events endpoints: URL;kv-events=PORT;kv-replay=PORT;kv-topic=T;kv-host=HOST "
        "(docs/gateway.md)",
        metavar="URL[,URL]",
    )
    discovery: str = option(
        "static",
        "static: the --workers list; k8s: watch the EndpointSlices of the worker Service; "
        "inferencepool: watch an InferencePool and its pods (docs/kubernetes.md)",
        choices=DISCOVERY_NAMES,
    )
    k8s_namespace: str | None = option(
        None, "namespace of the worker Service or InferencePool (k8s, inferencepool discovery)"
    )
    inference_pool: str | None = option(
        None, "InferencePool whose ready pods are the workers (inferencepool discovery)"
    )
    k8s_selector: str | None = option(
        None, "label selector of the worker EndpointSlices (k8s discovery)"
    )
    k8s_service: str | None = option(None, "worker Service name (k8s discovery)")
    k8s_port_name: str = option("http", "name of the workers' HTTP port (k8s discovery)")
    k8s_kv_events_port_name: str = option(
        "kv-events",
        "name of a plain vLLM worker's KV-events port (k8s discovery); absent: "
        "--vllm-kv-events-port",
    )
    k8s_kv_replay_port_name: str = option(
        "kv-replay",
        "name of a plain vLLM worker's KV-events replay port (k8s discovery); absent: "
        "--vllm-kv-events-replay-port",
    )
    host: str = option("127.0.0.1", "listen address")
    port: int = option(8080, "listen port")
    admin_port: int | None = option(
        None,
        "serve /metrics and /kvgate/index on this port (same address) and not on --port",
        default_text="none: on --port",
    )
    worker_token: str | None = option(
        None,
        "shared secret sent to every worker (`Authorization: Bearer`, also a vLLM worker's "
        "--api-key); it also keys the KV events' CURVE encryption",
        secret=True,
        default_text="env KVGATE_WORKER_TOKEN, else none",
        metavar="TOKEN",
    )
    epp: bool = option(
        False,
        "also serve the endpoint picker protocol (Envoy ext_proc over gRPC) on --epp-port: "
        "kvgate as the EPP of an InferencePool (docs/kubernetes.md)",
    )
    epp_port: int = option(9002, "gRPC port of the endpoint picker (--epp)")
    epp_tls_cert_file: str | None = option(
        None, "PEM certificate (chain): the endpoint picker serves TLS", metavar="PATH"
    )
    epp_tls_key_file: str | None = option(
        None, "PEM private key of --epp-tls-cert-file", metavar="PATH"
    )
    epp_fallbacks: int = option(
        0,
        "endpoints listed after the pick in x-gateway-destination-endpoint for a proxy that "
        "walks the list on retries (Envoy's override_host, Istio); 0: the pick alone, the one "
        "value every proxy takes (ORIGINAL_DST). In EPP mode the proxy retries, not --retries",
    )
    peer_port: int | None = option(
        None,
        "share placements and in-flight load with the other gateway replicas: publish them on "
        "this port (ZMQ PUB on --host, CURVE with --worker-token) and apply theirs "
        "(docs/gateway.md, Gateway peers)",
        default_text="none: no peers",
    )
    peers: tuple[str, ...] = option(
        (),
        "the gateway replicas' --peer-port addresses, comma-separated or repeated (this "
        "gateway's own may be listed: it ignores its own batches)",
        metavar="HOST:PORT[,HOST:PORT]",
    )
    peers_from_kubernetes: str | None = option(
        None,
        "also find the peers on Kubernetes: every pod in --k8s-namespace (else the pod's own) "
        "matching this label selector, at its IP and --peer-port (the chart labels its "
        "gateway and endpoint-picker pods alike)",
        metavar="SELECTOR",
    )
    peer_admission: str = option(
        "shares",
        "how peers bound --max-inflight-per-replica together: shares (each gateway also keeps "
        "within its share of every replica's cap, split by the gateways' demand: the cap holds "
        "under bursts) or counted (the peers' load counted, nothing more: a burst at several "
        "gateways overshoots it)",
        choices=("shares", "counted"),
    )
    peer_timeout: float = option(
        1.0,
        "seconds without a batch from a peer before its load and placements are dropped "
        "(a dead, lagging or partitioned peer: routing as without peers)",
    )
    policy: str = option(
        "cache_aware",
        "routing policy; a request may choose another with x-kvgate-routing-policy",
        choices=POLICY_NAMES,
    )
    model_dir: str | None = option(
        None,
        "local render assets (model directory)",
        default_text="fetched from a worker's /kvgate/assets",
        metavar="PATH",
    )
    index_max_blocks: int = option(1_000_000, "LRU cap on gateway keys in the block index")
    kv_events: bool = option(
        True,
        "ignore the workers' KV events: the index holds only what the gateway routed "
        "(speculative entries), as an approximate router does",
    )
    ignore_host_tier: bool = option(
        False,
        'route as if the workers had no host-memory tier: their `medium: "CPU"` KV events are '
        "kept in the index but a prefix held only there counts as uncached (the behaviour "
        "before the host tier; for comparison)",
    )
    speculative_ttl: float | None = option(
        None,
        "seconds a routed request's keys still count for its replica after it ended, for its "
        "events to arrive (without events: all the gateway knows, bounded by the cache size)",
        default_text="2.0; 120.0 with --no-kv-events",
    )
    retries: int = option(2, "extra replicas tried on a connect error or 5xx before the first byte")
    poison_ttl: float = option(
        600.0,
        "seconds a request that was in two kvgate workers' engines when they died is refused "
        "(400 engine_killer) without reaching a worker; it is tried on no third either way "
        "(docs/reliability.md). 0: not refused",
        metavar="SECONDS",
    )
    connect_timeout: float = option(2.0, "seconds to connect to a worker")
    request_timeout: float = option(600.0, "read timeout: seconds without a byte from the worker")
    drain_timeout: float = option(
        30.0,
        "seconds, after SIGTERM, that requests and streams in flight may take to finish: the "
        "gateway stops accepting connections and fails readiness at once, then exits when they "
        "are done or this has passed (docs/reliability.md)",
        metavar="SECONDS",
    )
    poll_interval: float = option(
        0.5, "seconds between polls of each worker's /kvgate/info, /health and /metrics"
    )
    start_wait: float = option(
        5.0,
        "seconds a request that arrives before the gateway has polled each worker once (a "
        "gateway just started) waits for those polls; then it is routed among the workers "
        "known, or refused 503 `starting` with Retry-After",
        metavar="SECONDS",
    )
    down_after_failed_polls: int = option(
        3,
        "polls in a row a healthy worker must leave unanswered (unreachable, or no answer in "
        "twice --connect-timeout) before it is marked down and its index entries dropped; an "
        "error from its /health marks it down at once",
    )
    max_polls_per_second: float | None = option(
        100.0,
        "workers polled per second at most: with more than --poll-interval x this many "
        "workers, each is polled less often (docs/kubernetes.md, Sizing); 0: no bound",
        parse=_rate_or_unbounded,
    )
    event_tail_check_interval: float = option(
        1.0,
        "seconds without a KV-event batch before asking the worker's replay buffer for batches "
        "the live stream missed: bounds how long a silent gap lasts (docs/reliability.md)",
    )
    max_tail_checks_per_second: float | None = option(
        50.0,
        "replay-buffer tail checks per second at most, over all workers: with more workers "
        "the interval above stretches for each; 0: no bound",
        parse=_rate_or_unbounded,
    )
    eject_after_failures: int = option(
        3, "consecutive failures that eject a replica (circuit breaker)"
    )
    eject_seconds: float = option(10.0, "seconds an ejected replica stays out")
    weights: CostWeights = field(
        default_factory=CostWeights,
        metadata=flag_group("cost weights of cache_aware (docs/gateway.md)"),
    )
    recent_half_life: float = option(60.0, "seconds; half-life of the recent-prefill cost term")
    softmax_temperature: float = option(
        0.0,
        "0 picks the lowest cost; > 0 samples the first choice from softmax(-cost/T), T in "
        "seconds of estimated cost",
    )
    session_header: str = option(SESSION_HEADER, "header whose value the session policy hashes")
    # Front door (docs/security.md): input limits, image fetching, tenants, overload.
    limits: RequestLimits = field(
        default_factory=RequestLimits, metadata=flag_group("input limits (docs/security.md)")
    )
    image_fetch_timeout: float = option(
        10.0, "seconds to fetch all the remote images of one request together"
    )
    image_fetch_max_bytes: int = option(
        32 * 2**20,
        "bytes of all the remote images of one request together",
        parse=parse_size,
        show=format_size,
        metavar="BYTES",
    )
    image_fetch_allow: tuple[str, ...] = option(
        (),
        "host names and CIDRs exempt from the SSRF guard, comma-separated or repeated",
        metavar="HOST|CIDR",
    )
    remote_images: bool = option(True, "refuse http(s) image URLs")
    allow_image_uuids: bool = option(
        False,
        "let a client's image uuid name the image, scoped to its tenant (docs/security.md)",
    )
    api_keys_file: str | None = option(
        None, "API key -> tenant file (JSON, YAML or lines); none: no API keys", metavar="PATH"
    )
    tenant_salt_secret: str | None = option(
        None,
        "HMAC secret of the tenants' cache salts",
        default_text="env KVGATE_TENANT_SALT_SECRET, else from the keys file",
    )
    max_inflight_per_replica: int | None = option(
        256,
        "requests in flight per replica before new ones queue; 0: unbounded",
        parse=_unbounded_if_zero,
    )
    max_queue: int = option(1024, "requests waiting for a slot before new ones get 429")
    queue_timeout: float = option(30.0, "seconds a request may wait for a slot before its 429")
    max_render_queue: int = option(
        64, "requests rendering or waiting for a render thread before new ones get 429"
    )
    # Plain vLLM workers (no /kvgate/info): where their --kv-events-config publishes.
    vllm_kv_events_port: int | None = option(
        None, "KV-events port of plain vLLM workers (no /kvgate/info)"
    )
    vllm_kv_events_replay_port: int | None = option(
        None, "KV-events replay port of plain vLLM workers"
    )
    vllm_kv_events_topic: str = option(
        "",
        "KV-events topic of plain vLLM workers; may name {host}, {port}, {pod}, {model}",
        default_text="every topic",
    )
    kv_events_bind: str | None = option(
        None,
        "connect mode: bind one SUB here (tcp://*:PORT) that plain vLLM workers' publishers "
        "connect to; rank r's on PORT + r. Each worker needs its own topic, and a "
        "replay port for what the SUB misses (docs/gateway.md)",
        metavar="ENDPOINT",
    )
    log_level: str = option(
        "info", "log level of kvgate's own logs (debug: every routing decision)", choices=LOG_LEVELS
    )
    log_level_http: str = option(
        "warning",
        "log level of the HTTP, gRPC and Kubernetes client libraries (httpx, httpcore, urllib3, "
        "grpc); at debug they log every poll's wire traffic",
        choices=LOG_LEVELS,
    )

    def __post_init__(self) -> None:
        check_config(self)  # normalizes a few fields, raises ValueError on a bad one
