"""A vLLM-shaped server for tests: vLLM's HTTP surface and KV-event sockets, real HTTP and ZMQ.

HTTP as vLLM serves it: no /kvgate/info, /health, /v1/models (the model with `max_model_len`,
its LoRA adapters with it as `parent`), /metrics with one `engine` label per data-parallel rank
(and `vllm:lora_requests_info` when it has adapters), and completions that record the body and
the `X-data-parallel-rank` header they were sent. Per rank, as vLLM's `ZmqEventPublisher` does: a
PUB on the events port + rank (bound; or connected to a central SUB in connect mode).

Its KV events come one of two ways:
- recorded (`docs`): frames recorded from vLLM 0.33.0 (tests/fixtures/vllm_0_33/), one batch per
  `publish`, and per rank a replay ROUTER on the replay port + rank that answers with vLLM's own
  recorded replies for the batches published so far. The frames are the recorded bytes; only
  the topic frame is replaced when a test gives the server a topic of its own.
- live (no `docs`): one rank that caches each completion's prompt tokens and publishes the new
  blocks as vLLM's array_like BlockStored, with 64-bit int hashes of its own. It keeps no replay
  buffer, so a batch published before the gateway's subscription arrived is lost for good.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import zmq

from cachekey.events import seq_bytes, seq_from_bytes
from harness.ports import free_port, free_port_run
from tests.support.paths import FIXTURES

RECORDED = FIXTURES / "vllm_0_33"
LIVE = {"block_size": 16, "topic": ""}  # live mode: vLLM's default block size and topic


def load(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


class PrefixCache:
    """Live mode's prefix cache: full blocks keyed by (LoRA adapter, token prefix), each with a
    vLLM-style int hash (the gateway re-keys blocks from their tokens, so any hash will do)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.hashes: dict[tuple[str | None, tuple[int, ...]], int] = {}

    def store(self, tokens: list[int], lora: str | None) -> tuple[int, list | None]:
        """(the tokens served from cache, the BlockStored event of the new blocks or None)."""
        bs, n_full = self.bs, len(tokens) // self.bs
        hit = 0
        while hit < n_full and (lora, tuple(tokens[: (hit + 1) * bs])) in self.hashes:
            hit += 1
        new = []
        for i in range(hit, n_full):
            key = (lora, tuple(tokens[: (i + 1) * bs]))
            self.hashes[key] = hash(key) & (2**63 - 1)
            new.append(self.hashes[key])
        cached = min(hit * bs, (len(tokens) - 1) // bs * bs)  # vLLM computes the last token
        if not new:
            return cached, None
        parent = self.hashes[(lora, tuple(tokens[: hit * bs]))] if hit else None
        extra = [[lora]] * len(new) if lora is not None else None  # the adapter in every block
        stored = tokens[hit * bs : n_full * bs]
        return cached, ["BlockStored", new, parent, stored, bs, None, "GPU", lora, extra]


class VllmLike:
    def __init__(
        self,
        docs: dict[int, dict] | None = None,
        *,
        model: str = "demo",
        max_model_len: int = 4096,
        topic: str | None = None,
        connect_to: str | None = None,
        adapters: tuple[str, ...] | list[str] = (),
    ) -> None:
        """`docs`: the recorded fixture of each rank (None: live mode, one rank). `connect_to`:
        the central SUB's base endpoint (tcp://HOST:PORT); rank r's PUB connects to PORT + r, as
        vLLM's does. `adapters`: the LoRA adapters it lists and accepts as `model`."""
        self.docs = docs or {}
        self.ranks = sorted(self.docs) or [0]
        self.model, self.max_model_len, self.adapters = model, max_model_len, list(adapters)
        first = self.docs[self.ranks[0]] if docs else LIVE
        self.block_size = first["block_size"]
        self.topic = (topic if topic is not None else first["topic"]).encode()
        n = max(self.ranks) + 1
        self.events_port = free_port_run(n)
        self.replay_port = free_port_run(n) if docs else None
        self.ctx = zmq.Context()
        self.pubs = {r: self._publisher(r, connect_to) for r in self.ranks}
        self.routers = {r: self._router(r) for r in self.ranks} if docs else {}
        self.published = dict.fromkeys(self.ranks, 0)
        self.waiting = dict.fromkeys(self.ranks, 0.0)  # each engine's vllm:num_requests_waiting
        self.rank_headers: list[str | None] = []
        self.prefix_headers: list[str | None] = []  # kvgate workers only get one
        self.bodies: list[dict] = []  # the request bodies the gateway forwarded
        # Called with the rank on its replay thread before each replay answer (a test's hook).
        self.before_replay: Callable[[int], None] | None = None
        self._cache = PrefixCache(self.block_size)
        # Guards the PUBs (the test thread and HTTP threads send) and the published counts.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay = threading.Thread(target=self._serve_replay, daemon=True)
        if self.routers:
            self._replay.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def _publisher(self, rank: int, connect_to: str | None) -> zmq.Socket:
        if connect_to is not None:
            base, _, port = connect_to.rpartition(":")
            pub = self.ctx.socket(zmq.PUB)
            pub.connect(f"{base}:{int(port) + rank}")
            return pub
        pub = self.ctx.socket(zmq.XPUB)  # tells the test when a subscription arrived
        pub.bind(f"tcp://127.0.0.1:{self.events_port + rank}")
        return pub

    def _router(self, rank: int) -> zmq.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{self.replay_port + rank}")
        return router

    @property
    def lora_seen(self) -> list[str]:
        """The adapter of each request that named one."""
        return [b["model"] for b in self.bodies if b.get("model") in self.adapters]

    # -- events ------------------------------------------------------------------------------

    def frames(self, rank: int, step: int) -> list[bytes]:
        _, seq, payload = (bytes.fromhex(f) for f in self.docs[rank]["steps"][step]["frames"])
        return [self.topic, seq, payload]

    def publish(self, rank: int, deliver: bool = True) -> None:
        """The rank's next recorded batch: sent live, or only kept for replay (lost live)."""
        with self._lock:
            step = self.published[rank]
            if deliver:
                self.pubs[rank].send_multipart(self.frames(rank, step))
            self.published[rank] = step + 1

    def serve(self, tokens: list[int], lora: str | None = None) -> int:
        """Live mode: cache the prompt's full blocks and publish what was new, as vLLM would;
        returns the tokens it had cached."""
        with self._lock:
            cached, event = self._cache.store(tokens, lora)
            if event is not None:
                payload = msgspec.msgpack.encode([time.time(), [event], None])
                self.pubs[0].send_multipart([self.topic, seq_bytes(self.published[0]), payload])
                self.published[0] += 1
            return cached

    def subscribed(self, rank: int = 0, timeout_ms: int = 10_000) -> None:
        """Bind mode: until a subscription has reached the rank's PUB (a batch sent before then
        is lost live)."""
        with self._lock:
            pub = self.pubs[rank]
            assert pub.poll(timeout_ms), f"rank {rank}: no subscriber"
            pub.recv()

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        for router in self.routers.values():
            poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                rank = next(r for r, s in self.routers.items() if s is sock)
                ident, _, start = sock.recv_multipart()
                if self.before_replay is not None:
                    self.before_replay(rank)
                replies = [[bytes.fromhex(f) for f in r] for r in self.docs[rank]["replay_from_0"]]
                with self._lock:
                    published = self.published[rank]
                for reply in replies[:-1]:
                    seq = seq_from_bytes(reply[2])
                    if seq_from_bytes(start) <= seq < published:
                        sock.send_multipart([ident, reply[0], self.topic, *reply[2:]])
                sock.send_multipart([ident, *replies[-1]])

    # -- HTTP --------------------------------------------------------------------------------

    def models(self) -> list[dict]:
        base = {"id": self.model, "parent": None, "max_model_len": self.max_model_len}
        return [base, *({**base, "id": a, "parent": self.model} for a in self.adapters)]

    def metrics(self) -> str:
        lines = []
        for r in self.ranks:
            labels = f'engine="{r}",model_name="{self.model}"'
            lines += [
                f'vllm:cache_config_info{{block_size="{self.block_size}",engine="{r}"}} 1.0',
                f"vllm:num_requests_running{{{labels}}} 0.0",
                f"vllm:num_requests_waiting{{{labels}}} {self.waiting[r]}",
                f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
            ]
        if self.adapters:  # vLLM writes it only with LoRA enabled; its value is when it was set
            lines.append(
                'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",'
                f'waiting_lora_adapters=""}} {time.time()}'
            )
        return "\n".join(lines) + "\n"

    def complete(self, body: dict) -> dict:
        usage: dict = {"prompt_tokens": 1, "completion_tokens": 1}
        if not self.docs:  # live mode: the prompt's tokens go through its prefix cache
            lora = body["model"] if body["model"] in self.adapters else None
            cached = self.serve(body["prompt"], lora)
            usage["prompt_tokens"] = len(body["prompt"])
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return {"choices": [{"text": "x", "index": 0}], "usage": usage}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"data": outer.models()}).encode())
                elif self.path == "/metrics":
                    self._send(200, outer.metrics().encode(), "text/plain")
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.rank_headers.append(self.headers.get("X-data-parallel-rank"))
                outer.prefix_headers.append(self.headers.get("x-kvgate-prefix"))
                outer.bodies.append(body)
                self._send(200, json.dumps(outer.complete(body)).encode())

            def log_message(self, *args) -> None:
                pass

        return Handler

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._stop.set()
        if self.routers:
            self._replay.join()
        for sock in [*self.pubs.values(), *self.routers.values()]:
            sock.close(linger=0)
        self.ctx.term()
