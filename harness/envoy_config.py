"""The configuration of a real Envoy in front of kvgate's endpoint picker (harness/envoy.py runs
it): the listener with the ext_proc filter, the pool cluster applying the pick, the access log.
docs/kubernetes.md explains each setting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.ports import HOST

DESTINATION = "x-gateway-destination-endpoint"
LB_MODES = ("original_dst", "override_host")
BODY_MODES = ("FULL_DUPLEX_STREAMED", "STREAMED", "BUFFERED")
# Headers a client must not set: the Gateway removes them before ext_proc sees the request
# (the EPP removes them too; this also covers requests that bypass a FailOpen EPP).
CLIENT_HEADERS_STRIPPED = (
    DESTINATION,
    f"{DESTINATION}-served",
    f"{DESTINATION}-subset",
    f"{DESTINATION}-fallback",
)
_ACCESS_LOG_FORMAT = {
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "upstream": "%UPSTREAM_HOST%",
    "picked": "%REQ(X-GATEWAY-DESTINATION-ENDPOINT)%",
    "path": "%REQ(:PATH)%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "tag": "%REQ(X-TEST-TAG)%",
    # Envoy's own clock, in microseconds: from the client's first byte to the upstream's first
    # (the request phase: with ext_proc, the EPP's pick), and from the upstream's last byte to
    # the client's last (the response phase).
    "request_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "response_us": "%COMMON_DURATION(US_RX_END:DS_TX_END:us)%",
}


@dataclass(slots=True)
class EnvoySpec:
    # The EPP's gRPC address, host:port; several, comma-separated: EPP replicas Envoy balances
    # its ext_proc streams over ("": the EPP scaled to zero, no endpoint).
    epp: str
    workers: Sequence[str] = ()  # worker base URLs: override_host's cluster members
    lb: str = "original_dst"  # how the pick is applied: original_dst or override_host
    body_mode: str = "FULL_DUPLEX_STREAMED"  # the request body mode sent to the EPP
    response_phase: bool = True  # response headers and body go to the EPP too
    failure_mode_allow: bool = False  # FailOpen: route without the EPP when it fails
    allow_mode_override: bool = False  # the EPP may switch the body mode (STREAMED: BUFFERED)
    retries: int = 0  # upstream retries (override_host walks the EPP's fallbacks)
    message_timeout_s: float = 10.0  # what a silent EPP costs each ext_proc message
    strip_client_headers: bool = True  # remove CLIENT_HEADERS_STRIPPED before ext_proc
    # Envoy reports where the request went with the response headers: the EPP counts it there,
    # and not at all when Envoy answered itself (no healthy upstream, a refused connection).
    response_attributes: tuple[str, ...] = ("upstream.address", "response.code_details")
    ext_proc: bool = True  # False: plain Envoy round robin over `workers` (a baseline)
    log_dir: Path = Path("bench/results/logs")
    port: int | None = None  # the listener; free port when None

    def __post_init__(self) -> None:
        if self.lb not in LB_MODES or self.body_mode not in BODY_MODES:
            raise ValueError(f"lb in {LB_MODES}, body_mode in {BODY_MODES}")
        if (self.lb == "override_host" or not self.ext_proc) and not self.workers:
            raise ValueError("override_host and plain round robin need the worker list")


def _typed(type_name: str, **fields: object) -> dict:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _address(host_port: str) -> dict:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _static_cluster(name: str, endpoints: Sequence[str], http2: bool = False) -> dict:
    cluster: dict = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(ep)}} for ep in endpoints]}
            ],
        },
    }
    if http2:
        options = _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}},
        )
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": options
        }
    return cluster


def _lb_key(key: str) -> dict:
    return {"key": "envoy.lb", "path": [{"key": key}]}


def pool_cluster(spec: EnvoySpec) -> dict:
    """The InferencePool's cluster: how Envoy applies the EPP's pick."""
    endpoints = [u.split("://", 1)[-1].rstrip("/") for u in spec.workers]
    if not spec.ext_proc:
        return _static_cluster("pool", endpoints)
    if spec.lb == "original_dst":
        return {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    cluster = _static_cluster("pool", endpoints)
    rr = "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
    round_robin = {"name": "envoy.load_balancing_policies.round_robin", "typed_config": _typed(rr)}
    override = _typed(
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[{"metadata": _lb_key(DESTINATION)}],
        selected_host_key=_lb_key(f"{DESTINATION}-served"),
        fallback_policy={"policies": [{"typed_extension_config": round_robin}]},
    )
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host", "typed_config": override,
    }}]}  # fmt: skip
    return cluster


def ext_proc_filter(spec: EnvoySpec) -> dict:
    response = "FULL_DUPLEX_STREAMED" if spec.response_phase else "NONE"
    mode = {
        "request_header_mode": "SEND",
        "request_body_mode": spec.body_mode,
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND" if spec.response_phase else "SKIP",
        "response_body_mode": response,
        "response_trailer_mode": "SEND" if spec.response_phase else "SKIP",
    }
    if spec.body_mode != "FULL_DUPLEX_STREAMED":  # trailers go with FULL_DUPLEX_STREAMED only
        mode["request_trailer_mode"] = "SKIP"
    if spec.response_phase and spec.body_mode != "FULL_DUPLEX_STREAMED":
        mode["response_body_mode"] = "STREAMED"
        mode["response_trailer_mode"] = "SKIP"
    config = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
        failure_mode_allow=spec.failure_mode_allow,
        message_timeout=f"{spec.message_timeout_s}s",
        processing_mode=mode,
        allow_mode_override=spec.allow_mode_override,
        response_attributes=list(spec.response_attributes),
        # envoy.lb both ways: the pick comes in, the served endpoint goes out.
        metadata_options={
            "forwarding_namespaces": {"untyped": ["envoy.lb"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    )
    return {"name": "envoy.filters.http.ext_proc", "typed_config": config}


def strip_filter() -> dict:
    """Removes the client's own destination headers before anything reads them."""
    mutations = [{"remove": name} for name in CLIENT_HEADERS_STRIPPED]
    config = _typed(
        "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        mutations={"request_mutations": mutations},
    )
    return {"name": "envoy.filters.http.header_mutation", "typed_config": config}


def route(spec: EnvoySpec) -> dict:
    action: dict = {"cluster": "pool", "timeout": "600s"}
    if spec.retries:
        action["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": spec.retries,
        }
    return {"match": {"prefix": "/"}, "route": action}


def bootstrap(spec: EnvoySpec, port: int, admin_port: int, access_log: Path) -> dict:
    filters = [strip_filter()] if spec.strip_client_headers else []
    if spec.ext_proc:
        filters.append(ext_proc_filter(spec))
    filters.append({
        "name": "envoy.filters.http.router",
        "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
    })  # fmt: skip
    log = {
        "name": "envoy.access_loggers.file",
        "typed_config": _typed(
            "envoy.extensions.access_loggers.file.v3.FileAccessLog",
            path=str(access_log),
            log_format={"json_format": _ACCESS_LOG_FORMAT},
        ),
    }
    hcm = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        access_log=[log],
        route_config={
            "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [route(spec)]}]
        },
        http_filters=filters,
    )
    listener = {
        "name": "gateway",
        "address": _address(f"{HOST}:{port}"),
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
        ]}],
    }  # fmt: skip
    clusters = [pool_cluster(spec)]
    if spec.ext_proc:
        epps = [e for e in spec.epp.split(",") if e]
        clusters.append(_static_cluster("epp", epps, http2=True))
    return {
        "admin": {"address": _address(f"{HOST}:{admin_port}")},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }
