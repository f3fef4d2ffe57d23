"""Where a worker is, and where its KV events are when it does not say so itself.

Discovery hands the replica set `WorkerEndpoint`s: the worker's base URL and, for a worker without
`/kvgate/info` (plain vLLM), its events endpoints: from the per-worker form of `--workers`

    http://10.0.0.5:8000;kv-events=5557;kv-replay=5558;kv-topic=kv@a@demo;kv-host=10.0.0.6

(`kv-host`: where its sockets are when not on the URL's host), or from the named ports of a
Kubernetes EndpointSlice. What a worker leaves out comes from the `--vllm-kv-events-*` flags.
The ports are vLLM's base ports: data-parallel rank r publishes on port + r, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

_FIELDS = ("kv-events", "kv-replay", "kv-topic", "kv-host")
TOPIC_FIELDS = ("host", "port", "pod", "model")


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    url: str
    kv_events_port: int | None = None  # vLLM's base port (rank r: + r)
    kv_replay_port: int | None = None
    kv_topic: str | None = None  # may hold {host}, {port}, {pod}, {model} (format_topic)
    kv_host: str | None = None  # None: the URL's host
    pod: str | None = None  # the Kubernetes pod behind the URL, when discovery knows it

    @property
    def host(self) -> str:
        """Where the worker's ZMQ sockets are."""
        return self.kv_host or urlsplit(self.url).hostname or "127.0.0.1"


def parse_worker(spec: str) -> WorkerEndpoint:
    """`URL[;kv-events=PORT][;kv-replay=PORT][;kv-topic=TOPIC][;kv-host=HOST]`; ValueError."""
    url, *fields = (part.strip() for part in spec.split(";"))
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://: {url!r}")
    values: dict[str, str] = {}
    for field in fields:
        name, eq, value = field.partition("=")
        if not eq or name not in _FIELDS:
            raise ValueError(
                f"worker {url}: unknown field {field!r}; expected {', '.join(_FIELDS)}"
            )
        if name in values:
            raise ValueError(f"worker {url}: {name} given twice")
        values[name] = value
    topic = values.get("kv-topic")
    if topic is not None:
        check_topic(topic)
    host = values.get("kv-host")
    if host is not None and not host.strip("[]"):
        raise ValueError(f"worker {url}: kv-host is empty")
    return WorkerEndpoint(
        url,
        _port(url, "kv-events", values.get("kv-events")),
        _port(url, "kv-replay", values.get("kv-replay")),
        topic,
        host.strip("[]") if host else None,
    )


def _port(url: str, name: str, text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"worker {url}: {name} must be a port (1-65535), got {text!r}")
    return int(text)


def check_topic(template: str) -> None:
    """A topic may name {host}, {port}, {pod} and {model}; anything else is a ValueError."""
    try:
        template.format(**dict.fromkeys(TOPIC_FIELDS, ""))
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"KV-events topic {template!r}: only {{host}}, {{port}}, {{pod}} and {{model}} may "
            f"be filled in ({e})"
        ) from None


def format_topic(template: str, host: str, port: int | None, pod: str | None, model: str) -> str:
    return template.format(host=host, port=port or "", pod=pod or host, model=model)


def parse_bind(endpoint: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> ("tcp://HOST", PORT): the central SUB binds PORT + rank for rank r."""
    base, colon, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not colon or not port.isdigit():
        raise ValueError(f"--kv-events-bind must be tcp://HOST:PORT, got {endpoint!r}")
    if not 0 < int(port) < 65536 or base == "tcp:/":
        raise ValueError(f"--kv-events-bind must be tcp://HOST:PORT, got {endpoint!r}")
    return base, int(port)
