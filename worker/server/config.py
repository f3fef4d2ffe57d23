"""Service settings (everything the CLI sets that is not the engine's)."""

from __future__ import annotations

from dataclasses import dataclass

from cachekey.bodies import DEFAULT_BUDGET_BODIES, DEFAULT_TIMEOUT_S, budget_bytes
from cachekey.images import check_max_pixels
from cachekey.render import RenderLimits
from cachekey.worker_auth import CurveKeys, resolve_token
from kvgate_cli.flags import (
    LOG_LEVELS,
    format_pixels,
    format_size,
    option,
    parse_pixels,
    parse_size,
)


@dataclass(slots=True)
class ServerConfig:
    host: str = option("0.0.0.0", "HTTP listen address; the ZMQ sockets bind on the same host")
    port: int = option(8000, "HTTP listen port")
    kv_events_port: int = option(5557, "ZMQ PUB port of the KV events; 0 disables KV events")
    kv_events_replay_port: int = option(
        5558, "ZMQ ROUTER port that replays KV events; 0 disables replay only"
    )
    kv_events_buffer: int = option(10_000, "event batches kept for replay")
    data_parallel_rank: int | None = option(
        None, "DP rank stamped into event batches (the first engine's, with several)"
    )
    data_parallel_size: int = option(
        1,
        "engines behind this server, each with its own KV cache (as vLLM's): engine i takes "
        "rank --data-parallel-rank + i and the KV-event ports + i; a request names one with "
        "X-data-parallel-rank: i, else goes to the least loaded",
    )
    allow_runtime_lora_updating: bool = option(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); they read local paths: keep them from clients",
    )
    enable_fault_injection: bool = option(
        False, "serve POST /debug/fault?kind=crash_engine|stall_engine|drop_events (tests only)"
    )
    engine_stall_timeout_s: float = option(
        30.0,
        "seconds without an engine-loop iteration before /health fails",
        name="--engine-stall-timeout",
    )
    # Who may call (docs/security.md): the gateways, holding the shared worker token.
    worker_token: str | None = option(
        None,
        "shared secret every endpoint but /health requires as `Authorization: Bearer`; it also "
        "keys the KV events' CURVE encryption",
        secret=True,
        default_text="env KVGATE_WORKER_TOKEN, else none: every endpoint is open",
        metavar="TOKEN",
    )
    unauthenticated_metrics: bool = option(
        False, "serve /metrics without the worker token (for a scraper that has none)"
    )
    # Request bodies, bounded before they are parsed. Keep each at least the gateway's: it
    # forwards what it accepted plus inlined remote images (up to --image-fetch-max-bytes,
    # base64) and a few fields per image (docs/security.md).
    max_body_bytes: int = option(
        128 * 2**20,
        "request body bytes (413 past it)",
        parse=parse_size,
        show=format_size,
        metavar="BYTES",
    )
    body_read_timeout: float = option(
        DEFAULT_TIMEOUT_S,
        "seconds from a request's headers to its body's end (408 past it, connection closed)",
        metavar="SECONDS",
    )
    body_read_budget: int | None = option(
        None,
        "bytes of the request bodies being read at once, across all connections (429 past it)",
        default_text=f"{DEFAULT_BUDGET_BODIES} x --max-body-bytes",
        parse=parse_size,
        show=format_size,
        metavar="BYTES",
    )
    # Images, as the gateway bounds them (its flags of the same names): keep each at least the
    # gateway's, or the workers refuse what the gateway forwards.
    max_images: int = option(32, "images per request", name="--max-images-per-request")
    max_image_bytes: int = option(
        20 * 2**20, "bytes per image (413 past it)", parse=parse_size, show=format_size,
        metavar="BYTES",
    )  # fmt: skip
    max_image_pixels: int = option(
        4096 * 4096, "pixels per image, WxH or a count (413 past it)", parse=parse_pixels,
        show=format_pixels, metavar="PIXELS",
    )  # fmt: skip
    max_json_depth: int = option(64, "JSON nesting depth of a request body (400 past it)")
    max_json_elements: int = option(
        1_100_000, "JSON values, keys and containers in a request body (400 past it)"
    )
    drain_timeout: float = option(
        30.0,
        "seconds, after SIGTERM, that requests and streams in flight may take to finish: the "
        "worker stops accepting connections and fails readiness at once, then exits when they "
        "are done or this has passed; a stream still open then ends with an SSE error event "
        "(docs/reliability.md)",
        metavar="SECONDS",
    )
    log_level: str = option("info", "log level", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        for name in ("port", "kv_events_port", "kv_events_replay_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        if self.kv_events_port and self.kv_events_port == self.kv_events_replay_port:
            raise ValueError("--kv-events-port and --kv-events-replay-port must differ")
        if self.kv_events_buffer <= 0:
            raise ValueError(f"--kv-events-buffer must be positive, got {self.kv_events_buffer}")
        if self.data_parallel_rank is not None and self.data_parallel_rank < 0:
            raise ValueError(f"--data-parallel-rank must be >= 0, got {self.data_parallel_rank}")
        n = self.data_parallel_size
        if n < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
        for name in ("kv_events_port", "kv_events_replay_port"):
            if getattr(self, name) and getattr(self, name) + n - 1 > 65535:
                raise ValueError(f"{name} + --data-parallel-size - 1 is past 65535")
        e, r = self.kv_events_port, self.kv_events_replay_port
        if e and r and e < r + n and r < e + n:
            raise ValueError(
                f"the KV-event ports of {n} engines ({e}-{e + n - 1}) and their replay ports "
                f"({r}-{r + n - 1}) overlap"
            )
        if self.drain_timeout < 0:
            raise ValueError("--drain-timeout must be >= 0")
        if self.engine_stall_timeout_s <= 0:
            raise ValueError("--engine-stall-timeout must be positive")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        for name in ("max_body_bytes", "max_json_depth", "max_json_elements", "max_image_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.max_images <= 0:
            raise ValueError("--max-images-per-request must be positive")
        check_max_pixels(self.max_image_pixels)
        if not self.body_read_timeout > 0:
            raise ValueError("--body-read-timeout must be positive")
        budget_bytes(self.body_read_budget, self.max_body_bytes)  # raises on a bad one
        self.worker_token = resolve_token(self.worker_token)

    def render_limits(self) -> RenderLimits:
        """What the API server's renderer takes of a request's images."""
        return RenderLimits(
            max_images=self.max_images,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
        )

    @property
    def events_enabled(self) -> bool:
        return self.kv_events_port != 0

    def engine_ranks(self) -> list[int | None]:
        """The data-parallel rank of each engine (None: one engine, not data parallel)."""
        n, first = self.data_parallel_size, self.data_parallel_rank
        if n == 1:
            return [first]
        return [(first or 0) + i for i in range(n)]

    @property
    def open_paths(self) -> frozenset[str]:
        """Paths answered without the worker token."""
        return frozenset({"/health", "/metrics"} if self.unauthenticated_metrics else {"/health"})

    @property
    def curve_keys(self) -> CurveKeys | None:
        """The KV events' CURVE keys: derived from the worker token, None without one."""
        return CurveKeys.from_token(self.worker_token) if self.worker_token else None

    @property
    def zmq_host(self) -> str:
        # ZMQ spells "every interface" as *, uvicorn as 0.0.0.0.
        return "*" if self.host in ("0.0.0.0", "", "::") else self.host
