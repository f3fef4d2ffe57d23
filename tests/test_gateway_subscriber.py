"""KVEventSubscriber against a real ZMQ PUB + ROUTER publisher driven by the test.

The publisher speaks the worker wire contract with `cachekey.events` (a real peer, as a vLLM
worker would be). A small real HTTP server stands in for `/kv/snapshot` only where a fault
needs a resync.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import zmq
import zmq.asyncio
from conftest import free_port

from cachekey.events import END_SEQ, BlockStored, encode_batch, seq_bytes, seq_from_bytes
from cachekey.keys import HashNamespace, block_keys
from gateway.index import BlockIndex, ReplicaId
from gateway.metrics import GatewayMetrics
from gateway.subscriber import EventSource, KVEventSubscriber

NS = HashNamespace("demo", block_size=4)
R = ReplicaId("http://worker")
TOPIC = "kv@inst1@demo"


class Publisher:
    """PUB for live batches, ROUTER (in a thread) for replay from a bounded buffer."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events, deliver: bool = True) -> int:
        seq, self.seq = self.seq, self.seq + 1
        payload = encode_batch(events)
        self.buffer.append((seq, payload))
        if deliver:
            self.pub.send_multipart([TOPIC.encode(), seq_bytes(seq), payload])
        return seq

    def _serve_replay(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, _, start = router.recv_multipart()
            for seq, payload in list(self.buffer):
                if seq >= seq_from_bytes(start):
                    router.send_multipart([ident, b"", seq_bytes(seq), payload])
            router.send_multipart([ident, b"", END_SEQ, b""])
        router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.ctx.term()


class SnapshotServer:
    def __init__(self) -> None:
        self.snapshot: dict = {"instance_id": "inst1", "seq": None, "block_size": 4, "blocks": []}
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                body = json.dumps(outer.snapshot).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/kv/snapshot"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chain(tokens: list[int], tag: bytes) -> tuple[list[BlockStored], list[bytes]]:
    """One BlockStored per full block, engine hashes tag+index, chained by parent."""
    events, hashes, parent = [], [], None
    for i in range(len(tokens) // 4):
        h = tag + bytes([i])
        events.append(BlockStored([h], parent, tokens[i * 4 : i * 4 + 4], 4))
        hashes.append(h)
        parent = h
    return events, hashes


def snapshot_blocks(tokens: list[int], tag: bytes) -> list[dict]:
    events, _ = chain(tokens, tag)
    return [
        {
            "key": e.block_hashes[0].hex(),
            "parent": e.parent_block_hash.hex() if e.parent_block_hash else None,
            "token_ids": e.token_ids,
            "extra_keys": [],
        }
        for e in events
    ]


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def run_scenario(scenario) -> None:
    pub, snap = Publisher(), SnapshotServer()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        index, metrics = BlockIndex(), GatewayMetrics()
        source = EventSource("inst1", "127.0.0.1", pub.port, pub.replay_port, TOPIC, snap.url)
        async with httpx.AsyncClient() as http:
            sub = KVEventSubscriber(R, source, NS, index, http, ctx, metrics, replay_timeout=1.0)
            task = asyncio.create_task(sub.run())
            await asyncio.wait_for(sub.synced.wait(), 5)
            await asyncio.sleep(0.2)  # let the SUB subscription reach the publisher
            try:
                await scenario(pub, snap, sub, index, metrics)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        ctx.term()

    try:
        asyncio.run(main())
    finally:
        pub.close()
        snap.close()


def _count(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_live_events_and_gap_closed_by_replay():
    t1, t2, t3 = list(range(8)), list(range(100, 108)), list(range(200, 208))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        await _until(lambda: index.match(block_keys(t1, NS), [R])[R] == 2)
        pub.publish(chain(t2, b"b")[0], deliver=False)  # lost on the wire
        pub.publish(chain(t3, b"c")[0])
        await _until(lambda: index.match(block_keys(t3, NS), [R])[R] == 2)
        assert index.match(block_keys(t2, NS), [R])[R] == 2
        assert _count(metrics, "kvgate_event_gaps_total") == 1
        assert _count(metrics, "kvgate_event_replays_total") == 1
        assert sub.last_seq == 2
        assert snap.hits == 1  # only the start-up snapshot

    run_scenario(scenario)


def test_replay_too_short_reloads_snapshot():
    t1, t2, t3 = list(range(8)), list(range(100, 108)), list(range(200, 208))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        await _until(lambda: index.match(block_keys(t1, NS), [R])[R] == 2)
        pub.publish(chain(t2, b"b")[0], deliver=False)
        pub.buffer.clear()  # the replay buffer no longer reaches back to seq 1
        # The worker's cache now holds t1 and t2 (seq 1 reflected), and t3 arrives as seq 2.
        snap.snapshot = {
            "instance_id": "inst1",
            "seq": 1,
            "block_size": 4,
            "blocks": snapshot_blocks(t1, b"a") + snapshot_blocks(t2, b"b"),
        }
        pub.publish(chain(t3, b"c")[0])
        await _until(lambda: index.match(block_keys(t3, NS), [R])[R] == 2)
        assert index.match(block_keys(t2, NS), [R])[R] == 2
        assert index.match(block_keys(t1, NS), [R])[R] == 2
        assert _count(metrics, "kvgate_event_resyncs_total") == 2  # start-up + this one
        assert snap.hits == 2

    run_scenario(scenario)


def test_seq_going_backwards_drops_and_resyncs():
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        pub.publish([])
        await _until(lambda: sub.last_seq == 1)
        # Engine restart under the same topic: seq starts again at 0 with an empty cache.
        snap.snapshot = {"instance_id": "inst1", "seq": None, "block_size": 4, "blocks": []}
        pub.seq = 0
        pub.buffer.clear()
        pub.publish(chain(t2, b"b")[0])
        await _until(lambda: index.match(block_keys(t2, NS), [R])[R] == 2)
        assert index.match(block_keys(t1, NS), [R])[R] == 0
        assert _count(metrics, "kvgate_event_resyncs_total") == 2

    run_scenario(scenario)


def test_copies_and_unknown_parent_over_the_wire():
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics):
        events, _ = chain(t1, b"a")
        pub.publish(events)
        await _until(lambda: sub.last_seq == 0)
        pub.publish(events)  # a second copy (seq 1): per-copy count goes to 2
        pub.publish([BlockStored([b"zz"], b"nope", t2[:4], 4)])  # unknown parent
        await _until(lambda: sub.last_seq == 2)
        assert index.match(block_keys(t1, NS), [R])[R] == 2
        assert _count(metrics, "kvgate_events_skipped_unknown_parent_total") == 1
        assert index.stats().copies == 4

    run_scenario(scenario)
