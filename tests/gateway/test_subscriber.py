"""KVEventSubscriber against a real ZMQ PUB + ROUTER publisher driven by the test.

The publisher speaks the worker wire contract with `cachekey.events` (a real peer, as a vLLM
worker would be); it is an XPUB, so the test knows when the gateway's subscription has arrived
instead of sleeping. A small real HTTP server stands in for `/kv/snapshot`, and a gated TCP relay
holds the SUB connection where a test needs the subscription not to be live yet.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from cachekey.events import (
    END_SEQ,
    BlockStored,
    KVEventBatch,
    encode_batch,
    seq_bytes,
    seq_from_bytes,
)
from cachekey.keys import HashNamespace, block_keys
from gateway.events.event_source import EventSource
from gateway.events.subscriber import KVEventSubscriber
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId
from harness.ports import free_port
from tests.support.metrics import sample
from tests.support.waits import until

NS = HashNamespace("demo", block_size=4)
R = ReplicaId("http://worker")
TOPIC = "kv@inst1@demo"


class Publisher:
    """XPUB for live batches, ROUTER (in a thread) for replay from a bounded buffer.

    `replay_frames` 4 answers as vLLM 0.33 does ([b"", topic, seq, payload]), 3 as vLLM did
    before PR #45177 ([b"", seq, payload]).
    """

    def __init__(self, replay_frames: int = 4) -> None:
        self.ctx = zmq.Context()
        self.port, self.replay_port = free_port(), free_port()
        self.replay_frames = replay_frames
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events, deliver: bool = True, ts: float | None = None) -> int:
        """`ts` stamps the batch as published then (default: now)."""
        seq, self.seq = self.seq, self.seq + 1
        payload = encode_batch(events)
        if ts is not None:
            payload = msgspec.msgpack.encode(KVEventBatch(ts=ts, events=list(events)))
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
            topic = [TOPIC.encode()] if self.replay_frames == 4 else []
            for seq, payload in list(self.buffer):
                if seq >= seq_from_bytes(start):
                    router.send_multipart([ident, b"", *topic, seq_bytes(seq), payload])
            router.send_multipart([ident, b"", *[b""] * len(topic), END_SEQ, b""])
        router.close(linger=0)

    async def subscribed(self, timeout: float = 5.0) -> None:
        """Until a subscriber's subscription to TOPIC has reached this socket."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.pub.poll(0):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("no subscription arrived")
            await asyncio.sleep(0.01)
        assert self.pub.recv() == b"\x01" + TOPIC.encode()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.ctx.term()


class SnapshotServer:
    def __init__(self) -> None:
        self.snapshot: dict = {"instance_id": "inst1", "seq": None, "block_size": 4, "blocks": []}
        self.hits = 0
        # Runs after the snapshot is taken and before it is answered (a worker publishing then).
        self.after_snapshot = lambda: None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                body = json.dumps(outer.snapshot).encode()
                outer.after_snapshot()
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


class GatedRelay:
    """A TCP relay on 127.0.0.1 that holds every connection until `open()`.

    A SUB connected through it is not live before then: whatever the publisher sends meanwhile
    is dropped by the PUB socket, exactly as before a real subscription completes.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._open = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def open(self) -> None:
        self._open.set()

    async def close(self) -> None:
        for t in self._pipes:
            t.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        if self._server is not None:
            self._server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(_pipe(src, dst))
            self._pipes.add(task)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    finally:
        dst.close()


def run_scenario(
    scenario, *, snapshot: bool = True, replay_frames: int = 4, gated: bool = False
) -> None:
    """Start a subscriber against a fresh publisher and run `scenario` once it has synced.

    With `gated`, the SUB connects through a closed GatedRelay and the scenario opens it; the
    scenario then starts before the subscription is live. Otherwise it starts once it is.
    """
    pub, snap = Publisher(replay_frames), SnapshotServer()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        index, metrics = BlockIndex(), GatewayMetrics()
        relay = GatedRelay(pub.port)
        port = await relay.start() if gated else pub.port
        if not gated:
            relay.open()
        source = EventSource(
            "inst1", "127.0.0.1", port, pub.replay_port, TOPIC, snap.url if snapshot else None
        )
        async with httpx.AsyncClient() as http:
            sub = KVEventSubscriber(
                R, source, NS, index, http, ctx, metrics,
                replay_timeout=1.0, tail_check_interval=0.05,
            )  # fmt: skip
            task = asyncio.create_task(sub.run())
            try:
                if gated:
                    await scenario(pub, snap, sub, index, metrics, relay)
                else:
                    await asyncio.wait_for(sub.synced.wait(), 5)
                    await pub.subscribed()
                    await scenario(pub, snap, sub, index, metrics)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await relay.close()
        ctx.term()

    try:
        asyncio.run(main())
    finally:
        pub.close()
        snap.close()


def test_live_events_and_gap_closed_by_replay():
    t1, t2, t3 = list(range(8)), list(range(100, 108)), list(range(200, 208))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        await until(lambda: index.lookup.match(block_keys(t1, NS), [R])[R] == 2)
        pub.publish(chain(t2, b"b")[0], deliver=False)  # lost on the wire
        pub.publish(chain(t3, b"c")[0])
        await until(lambda: index.lookup.match(block_keys(t3, NS), [R])[R] == 2)
        assert index.lookup.match(block_keys(t2, NS), [R])[R] == 2
        assert sample(metrics, "kvgate_event_gaps_total") == 1
        assert sample(metrics, "kvgate_event_replays_total") == 1
        assert sub.last_seq == 2
        assert snap.hits == 1  # only the start-up snapshot

    run_scenario(scenario)


def test_event_lag_and_ingest_cpu_are_measured_per_batch():
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        await until(lambda: index.lookup.match(block_keys(t1, NS), [R])[R] == 2, "first batch")
        pub.publish(chain(t2, b"b")[0], ts=time.time() - 7.0)  # stamped 7 s ago
        await until(lambda: index.lookup.match(block_keys(t2, NS), [R])[R] == 2, "second batch")
        assert sample(metrics, "kvgate_event_lag_seconds_count") == 2
        fresh = sample(metrics, "kvgate_event_lag_seconds_bucket", {"le": "5.0"})
        assert fresh == 1  # the first batch; the stale one lands in the 10 s bucket
        assert 7.0 <= sample(metrics, "kvgate_event_lag_seconds_sum") < 7.0 + 5.0
        assert 0 < sample(metrics, "kvgate_event_ingest_cpu_seconds_total") < 1.0

    run_scenario(scenario)


def test_replay_too_short_reloads_snapshot():
    t1, t2, t3 = list(range(8)), list(range(100, 108)), list(range(200, 208))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        await until(lambda: index.lookup.match(block_keys(t1, NS), [R])[R] == 2)
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
        await until(lambda: index.lookup.match(block_keys(t3, NS), [R])[R] == 2)
        assert index.lookup.match(block_keys(t2, NS), [R])[R] == 2
        assert index.lookup.match(block_keys(t1, NS), [R])[R] == 2
        assert sample(metrics, "kvgate_event_resyncs_total") == 2  # start-up + this one
        assert snap.hits == 2

    run_scenario(scenario)


def test_seq_going_backwards_drops_and_resyncs():
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics):
        pub.publish(chain(t1, b"a")[0])
        pub.publish([])
        await until(lambda: sub.last_seq == 1)
        # Engine restart under the same topic: seq starts again at 0 with an empty cache.
        snap.snapshot = {"instance_id": "inst1", "seq": None, "block_size": 4, "blocks": []}
        pub.seq = 0
        pub.buffer.clear()
        pub.publish(chain(t2, b"b")[0])
        await until(lambda: index.lookup.match(block_keys(t2, NS), [R])[R] == 2)
        assert index.lookup.match(block_keys(t1, NS), [R])[R] == 0
        assert sample(metrics, "kvgate_event_resyncs_total") == 2

    run_scenario(scenario)


def test_copies_and_unknown_parent_over_the_wire():
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics):
        events, _ = chain(t1, b"a")
        pub.publish(events)
        await until(lambda: sub.last_seq == 0)
        pub.publish(events)  # a second copy (seq 1): per-copy count goes to 2
        pub.publish([BlockStored([b"zz"], b"nope", t2[:4], 4)])  # unknown parent
        await until(lambda: sub.last_seq == 2)
        assert index.lookup.match(block_keys(t1, NS), [R])[R] == 2
        assert sample(metrics, "kvgate_events_skipped_unknown_parent_total") == 1
        assert index.stats().copies == 4

    run_scenario(scenario)


def _held(index: BlockIndex, tokens: list[int]) -> int:
    return index.lookup.match(block_keys(tokens, NS), [R])[R]


def test_batch_lost_before_the_sub_is_live_is_found_by_the_tail_check():
    """The race of issue 11, provoked: the worker publishes right after the snapshot, while the
    gateway's subscription has not reached it, and then nothing more. No later batch reveals the
    gap; the replay check after an idle interval closes it."""
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics, relay):
        pub.publish(chain(t1, b"a")[0])
        snap.snapshot = {
            "instance_id": "inst1",
            "seq": 0,
            "block_size": 4,
            "blocks": snapshot_blocks(t1, b"a"),
        }
        await asyncio.wait_for(sub.synced.wait(), 5)  # snapshot loaded, nothing after it yet
        assert _held(index, t1) == 2 and _held(index, t2) == 0
        pub.publish(chain(t2, b"b")[0])  # no live subscription: the XPUB drops it
        relay.open()
        await pub.subscribed()
        await until(lambda: _held(index, t2) == 2)
        assert sub.last_seq == 1
        assert sample(metrics, "kvgate_event_tail_gaps_total") == 1
        assert sample(metrics, "kvgate_event_gaps_total") == 1
        assert sample(metrics, "kvgate_event_replays_total") == 1
        assert sample(metrics, "kvgate_event_resyncs_total") == 1  # only the start

    run_scenario(scenario, gated=True)


def test_batch_published_while_the_snapshot_is_served_is_applied_before_synced():
    """A batch the worker publishes between taking the snapshot and the subscription going live
    is fetched by the replay that follows the snapshot, before the subscriber says it is synced."""
    t1 = list(range(8))

    async def scenario(pub, snap, sub, index, metrics, relay):
        snap.after_snapshot = lambda: pub.publish(chain(t1, b"a")[0])  # seq 0, after seq None
        await asyncio.wait_for(sub.synced.wait(), 5)
        assert _held(index, t1) == 2 and sub.last_seq == 0
        assert sample(metrics, "kvgate_event_tail_gaps_total") == 0
        relay.open()
        await pub.subscribed()

    run_scenario(scenario, gated=True)


@pytest.mark.parametrize("replay_frames", [4, 3])
def test_plain_vllm_worker_rebuilt_from_replay_alone(replay_frames):
    """No snapshot (plain vLLM): history published before the gateway started comes from the
    replay buffer, in vLLM 0.33's reply layout and in the one before PR #45177; a batch lost
    later, with nothing after it, is still found."""
    t1, t2, t3 = list(range(8)), list(range(100, 108)), list(range(200, 208))

    async def scenario(pub, snap, sub, index, metrics, relay):
        pub.publish(chain(t1, b"a")[0])
        pub.publish(chain(t2, b"b")[0])
        await asyncio.wait_for(sub.synced.wait(), 5)
        assert _held(index, t1) == _held(index, t2) == 2 and sub.last_seq == 1
        relay.open()
        await pub.subscribed()
        pub.publish(chain(t3, b"c")[0], deliver=False)
        await until(lambda: _held(index, t3) == 2)
        assert sample(metrics, "kvgate_event_tail_gaps_total") == 1
        assert snap.hits == 0

    run_scenario(scenario, snapshot=False, replay_frames=replay_frames, gated=True)


def test_replay_buffer_that_rolled_over_starts_a_vllm_index_at_its_oldest_batch():
    t1, t2 = list(range(8)), list(range(100, 108))

    async def scenario(pub, snap, sub, index, metrics, relay):
        pub.publish(chain(t1, b"a")[0])
        events, _ = chain(t2, b"b")
        pub.publish(events[:1])
        pub.publish(events[1:])
        del pub.buffer[:2]  # only seq 2 is left: t1 and t2's first block are gone
        await asyncio.wait_for(sub.synced.wait(), 5)
        assert sub.last_seq == 2
        # t2's second block names a parent the gateway never saw: skipped, never mis-keyed.
        assert _held(index, t1) == _held(index, t2) == 0
        assert sample(metrics, "kvgate_events_skipped_unknown_parent_total") == 1
        relay.open()

    run_scenario(scenario, snapshot=False, gated=True)
