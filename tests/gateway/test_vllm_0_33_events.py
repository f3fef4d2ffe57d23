"""The gateway's index against vLLM 0.33.0's own KV events, checked after every step.

The fixtures in tests/fixtures/vllm_0_33/ were recorded from vLLM 0.33.0 (its KVCacheManager and
ZmqEventPublisher; generate.py there says how). Each step holds the frames vLLM's PUB sent and,
for probe requests, how many prompt tokens vLLM's own prefix cache would hit at that point. The
index, fed those exact bytes, must predict exactly that. The last test serves the recorded frames
over real ZMQ sockets, replies of vLLM's replay ROUTER included, to the real subscriber.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import zmq
import zmq.asyncio

from cachekey.events import decode_batch, parse_replay_reply, seq_from_bytes
from cachekey.keys import HashNamespace, block_keys, usable_match
from cachekey.types import MMItem
from gateway.events.event_source import EventSource
from gateway.events.subscriber import KVEventSubscriber
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId
from tests.support.metrics import sample
from tests.support.paths import FIXTURES
from tests.support.waits import until

RECORDED = FIXTURES / "vllm_0_33"
SCENARIOS = sorted(p.stem for p in RECORDED.glob("*.json"))
R = ReplicaId("http://vllm")
NS = HashNamespace("demo", block_size=4)


def load(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def predicted(index: BlockIndex, probe: dict) -> int:
    """What the gateway predicts for a probe: the match, kept where it ends inside an image."""
    tokens = probe["tokens"]
    mm = tuple(MMItem(i, "image", off, n) for i, off, n in probe.get("mm", ()))
    keys = block_keys(tokens, NS, mm, probe.get("lora"), probe.get("salt"))
    n = index.lookup.match(keys, [R], tokens=tokens, mm_items=mm)[R]
    return usable_match(n * NS.block_size, len(tokens), NS.block_size, mm, "partial")


def test_every_scenario_is_there():
    assert set(SCENARIOS) >= {
        "incremental_int",
        "incremental_bytes",
        "report_mode_full",
        "duplicate_copies",
        "hybrid_sliding_window",
        "lookahead",
        "cpu_tier",
        "extra_keys",
    }


@pytest.mark.parametrize("name", SCENARIOS)
def test_index_predicts_what_vllm_hits_after_every_step(name):
    doc = load(name)
    assert doc["vllm_version"] == "0.33.0"
    index = BlockIndex()
    index.set_reannouncing(R)  # a plain vLLM worker (no snapshot)
    for i, step in enumerate(doc["steps"]):
        topic, seq, payload = (bytes.fromhex(f) for f in step["frames"])
        assert topic == doc["topic"].encode() and seq_from_bytes(seq) == i
        batch = decode_batch(payload)
        assert batch.errors == [] and batch.data_parallel_rank == 0
        index.apply(R, NS, batch.events)
        for probe in step["probes"]:
            assert predicted(index, probe) == probe["vllm_hit_tokens"], (step["note"], probe)


@pytest.mark.parametrize("name", SCENARIOS)
def test_replay_replies_carry_the_live_frames(name):
    """vLLM 0.33's ROUTER answers [b"", topic, seq, payload] and ends with seq -1."""
    doc = load(name)
    replies = [[bytes.fromhex(f) for f in r] for r in doc["replay_from_0"]]
    assert all(len(r) == 4 for r in replies)
    live = [(i, bytes.fromhex(s["frames"][2])) for i, s in enumerate(doc["steps"])]
    assert [parse_replay_reply(r) for r in replies] == [*live, None]


def test_a_reannounce_then_one_eviction_is_a_miss():
    """The naive count (one copy per store) would still predict 8 tokens after the eviction."""
    steps = load("report_mode_full")["steps"]
    assert [p["vllm_hit_tokens"] for s in steps for p in s["probes"]] == [8, 8, 4]


class RecordedVllm:
    """Serves recorded vLLM frames byte for byte: an XPUB for live frames, a ROUTER that answers
    a replay request with vLLM's recorded replies for the batches published so far."""

    def __init__(self, doc: dict) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.frames = [[bytes.fromhex(f) for f in s["frames"]] for s in doc["steps"]]
        self.replies = [[bytes.fromhex(f) for f in r] for r in doc["replay_from_0"]]
        self.published = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, deliver: bool = True) -> None:
        if deliver:
            self.pub.send_multipart(self.frames[self.published])
        self.published += 1

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, _, start = self.router.recv_multipart()
            for reply in self.replies[:-1]:
                seq = seq_from_bytes(reply[2])
                if seq_from_bytes(start) <= seq < self.published:
                    self.router.send_multipart([ident, *reply])
            self.router.send_multipart([ident, *self.replies[-1]])

    async def subscribed(self) -> None:
        while not self.pub.poll(0):
            await asyncio.sleep(0.01)
        self.pub.recv()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def test_recorded_vllm_stream_with_a_gap_closed_by_vllms_replay():
    doc = load("incremental_int")
    vllm = RecordedVllm(doc)

    async def main() -> None:
        ctx, index, metrics = zmq.asyncio.Context(), BlockIndex(), GatewayMetrics()
        source = EventSource("vllm", "127.0.0.1", vllm.port, vllm.replay_port, doc["topic"], None)
        async with httpx.AsyncClient() as http:
            sub = KVEventSubscriber(
                R, source, NS, index, http, ctx, metrics, replay_timeout=1.0,
                tail_check_interval=5.0,
            )  # fmt: skip
            task = asyncio.create_task(sub.run())
            try:
                await asyncio.wait_for(sub.synced.wait(), 5)
                await vllm.subscribed()
                vllm.publish()
                await until(lambda: sub.last_seq == 0)
                vllm.publish(deliver=False)  # lost on the wire; vLLM's replay has it
                vllm.publish()
                await until(lambda: sub.last_seq == 2)
                for probe in doc["steps"][2]["probes"]:
                    assert predicted(index, probe) == probe["vllm_hit_tokens"]
                assert sample(metrics, "kvgate_event_replays_total") == 1
                assert sample(metrics, "kvgate_event_resyncs_total") == 1  # the start only
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        ctx.term()

    try:
        asyncio.run(main())
    finally:
        vllm.close()
