"""Service settings (everything the CLI sets that is not the engine's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    # 0 disables KV events (PUB, replay and the seq in /kv/snapshot).
    kv_events_port: int = 5557
    # 0 disables only the replay socket.
    kv_events_replay_port: int = 5558
    kv_events_buffer: int = 10_000
    data_parallel_rank: int | None = None
    enable_fault_injection: bool = False
    # /health fails when the engine loop has not iterated for this long.
    engine_stall_timeout_s: float = 30.0
    log_level: str = "info"

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
        if self.engine_stall_timeout_s <= 0:
            raise ValueError("--engine-stall-timeout must be positive")

    @property
    def events_enabled(self) -> bool:
        return self.kv_events_port != 0

    @property
    def zmq_host(self) -> str:
        # ZMQ spells "every interface" as *, uvicorn as 0.0.0.0.
        return "*" if self.host in ("0.0.0.0", "", "::") else self.host
