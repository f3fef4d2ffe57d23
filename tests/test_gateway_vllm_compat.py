"""A plain vLLM worker behind the gateway: no /kvgate/info, vLLM's positional events, int hashes.

The peer here is a small vLLM-shaped server (HTTP + ZMQ PUB) written for the test: it speaks
vLLM's wire formats (`/v1/models`, `vllm:cache_config_info`, array_like KV events with 64-bit
int block hashes from its own hash function), so the gateway's real code path is exercised.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
import zmq
from conftest import free_port

from cachekey.events import seq_bytes
from harness.cluster import Proc

BS = 16


class FakeVllm:
    def __init__(self, adapters: tuple[str, ...] | list[str] = (), lora_metric: bool = False):
        self.adapters = list(adapters)
        self.lora_metric = lora_metric
        self.lora_seen: list[str] = []  # the adapter of each request that named one
        self.events_port = free_port()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)  # tells the test when a subscription arrived
        self._pub.bind(f"tcp://127.0.0.1:{self.events_port}")
        self._lock = threading.Lock()
        self._seq = 0
        # (LoRA name, token prefix) -> vLLM-style int hash
        self._stored: dict[tuple[str | None, tuple[int, ...]], int] = {}
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
                    data = [{"id": "demo", "parent": None}]
                    data += [{"id": a, "parent": "demo"} for a in outer.adapters]
                    self._send(200, json.dumps({"data": data}).encode())
                elif self.path == "/metrics":
                    text = (
                        'vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0\n'
                        'vllm:num_requests_waiting{model_name="demo"} 0.0\n'
                    )
                    if outer.lora_metric:
                        text += (
                            'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",'
                            f'waiting_lora_adapters=""}} {time.time()}\n'
                        )
                    self._send(200, text.encode(), "text/plain")
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                lora = body["model"] if body["model"] in outer.adapters else None
                if lora is not None:
                    outer.lora_seen.append(lora)
                cached = outer.serve(body["prompt"], lora)
                usage = {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                resp = {"choices": [{"text": "x", "index": 0}], "usage": usage}
                self._send(200, json.dumps(resp).encode())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def subscribed(self, timeout_ms: int = 10_000) -> None:
        """Until a subscription has reached the PUB. This server keeps no replay buffer, so a
        batch published before that is lost for good."""
        with self._lock:
            assert self._pub.poll(timeout_ms), "no subscriber"
            self._pub.recv()

    def serve(self, tokens: list[int], lora: str | None = None) -> int:
        """Cache the prompt's full blocks and publish what was new, as vLLM would (a LoRA
        adapter's name in every block's extra keys)."""
        with self._lock:
            n_full = len(tokens) // BS
            hit = 0
            while hit < n_full and (lora, tuple(tokens[: (hit + 1) * BS])) in self._stored:
                hit += 1
            new_hashes = []
            for i in range(hit, n_full):
                prefix = (lora, tuple(tokens[: (i + 1) * BS]))
                self._stored[prefix] = hash(prefix) & (2**63 - 1)
                new_hashes.append(self._stored[prefix])
            if new_hashes:
                parent = self._stored[(lora, tuple(tokens[: hit * BS]))] if hit else None
                extra = [[lora]] * len(new_hashes) if lora is not None else None
                event = [
                    "BlockStored",
                    new_hashes,
                    parent,
                    tokens[hit * BS : n_full * BS],
                    BS,
                    None,
                    "GPU",
                    lora,
                    extra,
                ]
                payload = msgspec.msgpack.encode([time.time(), [event], None])
                self._pub.send_multipart([b"", seq_bytes(self._seq), payload])
                self._seq += 1
            max_hit = ((len(tokens) - 1) // BS) * BS
            return min(hit * BS, max_hit)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._pub.close(linger=0)
        self._ctx.term()


@pytest.fixture()
def fake_vllm():
    fake = FakeVllm()
    yield fake
    fake.close()


def test_plain_vllm_worker_is_indexed_from_its_events(tmp_path, demo_model_dir, fake_vllm):
    port = free_port()
    args = [
        "-m",
        "gateway",
        "--workers",
        fake_vllm.url,
        "--port",
        str(port),
        "--model-dir",
        str(demo_model_dir),
        "--vllm-kv-events-port",
        str(fake_vllm.events_port),
        "--poll-interval",
        "0.2",
    ]
    gw = Proc("gateway", args, port, tmp_path / "gw.log")
    gw.start()
    try:
        gw.wait_healthy(60)
        deadline = time.monotonic() + 10
        while not httpx.get(f"{gw.url}/kvgate/index").json()["replicas"][fake_vllm.url]["synced"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        fake_vllm.subscribed()
        prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
        body = {"model": "demo", "prompt": prompt, "max_tokens": 1}
        first = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        assert first.headers["x-kvgate-predicted-cached-tokens"] == "0"
        deadline = time.monotonic() + 10
        while httpx.get(f"{gw.url}/kvgate/index").json()["replicas"][fake_vllm.url]["blocks"] < 3:
            assert time.monotonic() < deadline, gw.log_tail()
            time.sleep(0.1)
        second = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert second.headers["x-kvgate-predicted-cached-tokens"] == "48"
    finally:
        gw.kill()
