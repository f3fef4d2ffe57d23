"""A vLLM-shaped server that replays frames recorded from vLLM 0.33.0 (tests/fixtures/vllm_0_33/).

HTTP as vLLM serves it: no /kvgate/info, /health, /v1/models (with `max_model_len`), /metrics
with one `engine` label per data-parallel rank, and completions that record the
`X-data-parallel-rank` header they were sent. Per rank, as vLLM's `ZmqEventPublisher` does: a
PUB on the events port + rank (bound; or connected to a central SUB in connect mode), and a
replay ROUTER on the replay port + rank that answers with vLLM's own recorded replies for the
batches published so far. The frames are the recorded bytes; only the topic frame is replaced
when a test gives the server a topic of its own.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import zmq
from conftest import free_port

from cachekey.events import seq_from_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_0_33"


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def free_port_run(n: int) -> int:
    """A port p such that p .. p + n - 1 are all free (a base port and its ranks' offsets)."""
    while True:
        run = [free_port()]
        while len(run) < n and (q := free_port()) == run[-1] + 1:
            run.append(q)
        if len(run) == n:
            return run[0]


class VllmLike:
    def __init__(
        self,
        docs: dict[int, dict],
        *,
        model: str = "demo",
        max_model_len: int = 4096,
        topic: str | None = None,
        connect_to: str | None = None,
    ) -> None:
        """`docs`: the recorded fixture of each rank. `connect_to`: the central SUB's base
        endpoint (tcp://HOST:PORT); rank r's PUB connects to PORT + r, as vLLM's does."""
        self.docs = docs
        self.ranks = sorted(docs)
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = next(iter(docs.values()))["block_size"]
        self.topic = (topic if topic is not None else docs[self.ranks[0]]["topic"]).encode()
        n = max(self.ranks) + 1
        self.events_port, self.replay_port = free_port_run(n), free_port_run(n)
        self.ctx = zmq.Context()
        self.pubs: dict[int, zmq.Socket] = {}
        self.routers: dict[int, zmq.Socket] = {}
        for r in self.ranks:
            if connect_to is None:
                pub = self.ctx.socket(zmq.XPUB)  # tells the test when a subscription arrived
                pub.bind(f"tcp://127.0.0.1:{self.events_port + r}")
            else:
                base, _, port = connect_to.rpartition(":")
                pub = self.ctx.socket(zmq.PUB)
                pub.connect(f"{base}:{int(port) + r}")
            self.pubs[r] = pub
            router = self.ctx.socket(zmq.ROUTER)
            router.bind(f"tcp://127.0.0.1:{self.replay_port + r}")
            self.routers[r] = router
        self.published = dict.fromkeys(self.ranks, 0)
        self.waiting = dict.fromkeys(self.ranks, 0.0)  # each engine's vllm:num_requests_waiting
        self.rank_headers: list[str | None] = []
        self.prefix_headers: list[str | None] = []  # kvgate workers only get one
        self.bodies: list[dict] = []  # the request bodies the gateway forwarded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay = threading.Thread(target=self._serve_replay, daemon=True)
        self._replay.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

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

    def subscribed(self, rank: int, timeout_ms: int = 10_000) -> None:
        """Bind mode: until a subscription has reached the rank's PUB."""
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
                replies = [[bytes.fromhex(f) for f in r] for r in self.docs[rank]["replay_from_0"]]
                with self._lock:
                    published = self.published[rank]
                for reply in replies[:-1]:
                    seq = seq_from_bytes(reply[2])
                    if seq_from_bytes(start) <= seq < published:
                        sock.send_multipart([ident, reply[0], self.topic, *reply[2:]])
                sock.send_multipart([ident, *replies[-1]])

    # -- HTTP --------------------------------------------------------------------------------

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
        return "\n".join(lines) + "\n"

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
                    card = {"id": outer.model, "max_model_len": outer.max_model_len}
                    self._send(200, json.dumps({"data": [card]}).encode())
                elif self.path == "/metrics":
                    self._send(200, outer.metrics().encode(), "text/plain")
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.rank_headers.append(self.headers.get("X-data-parallel-rank"))
                outer.prefix_headers.append(self.headers.get("x-kvgate-prefix"))
                outer.bodies.append(body)
                usage = {"prompt_tokens": 1, "completion_tokens": 1}
                resp = {"choices": [{"text": "x", "index": 0}], "usage": usage}
                self._send(200, json.dumps(resp).encode())

            def log_message(self, *args) -> None:
                pass

        return Handler

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._stop.set()
        self._replay.join()
        for sock in [*self.pubs.values(), *self.routers.values()]:
            sock.close(linger=0)
        self.ctx.term()
