"""KV events from a live sim worker over real ZMQ sockets: live, late and lossy subscribers all
rebuild exactly the block set that /kv/snapshot reports."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import httpx
import pytest
import zmq

from cachekey.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_replay_reply,
    seq_bytes,
    seq_from_bytes,
)
from cachekey.keys import HashNamespace, block_keys
from tests.support.worker_harness import WorkerProcess

NUM_BLOCKS = 24


class Subscriber:
    """A consumer as a gateway would write one: SUB for live batches, DEALER to fill gaps."""

    def __init__(self, ctx: zmq.Context, worker: WorkerProcess, drop_every: int | None = None):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(f"tcp://127.0.0.1:{worker.events_port}")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{worker.replay_port}")
        self.keys: Counter[bytes] = Counter()
        self.next_seq = 0
        self.drop_every = drop_every
        self.received = self.dropped = self.replayed = self.removed = self.cleared = 0
        self.topics: set[bytes] = set()

    def load_snapshot(self, snap: dict) -> None:
        self.keys = Counter(bytes.fromhex(b["key"]) for b in snap["blocks"])
        self.next_seq = 0 if snap["seq"] is None else snap["seq"] + 1

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq
        batch = decode_batch(payload)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert all(isinstance(h, bytes) and len(h) == 16 for h in ev.block_hashes)
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                self.keys.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed += len(ev.block_hashes)
                self.keys.subtract(ev.block_hashes)
                assert min(self.keys.values(), default=0) >= 0, "removed a block never stored"
                self.keys = +self.keys
            elif isinstance(ev, AllBlocksCleared):
                self.cleared += 1
                self.keys.clear()
        self.next_seq = seq + 1

    def replay_from(self, start: int) -> None:
        self.dealer.send_multipart([b"", seq_bytes(start)])
        while True:
            assert self.dealer.poll(5000), "no replay answer"
            frames = self.dealer.recv_multipart()
            # vLLM 0.33's layout: [b"", topic, seq, payload], ending with [b"", b"", -1, b""].
            assert len(frames) == 4 and frames[0] == b"", frames
            item = parse_replay_reply(frames)
            if item is None:
                assert frames[1:] == [b"", END_SEQ, b""]
                return
            assert frames[1].startswith(b"kv@")
            seq, payload = item
            if seq == self.next_seq:
                self.apply(seq, payload)
                self.replayed += 1

    def pump(self, timeout_ms: int = 50) -> None:
        while self.sub.poll(timeout_ms):
            topic, raw_seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = seq_from_bytes(raw_seq)
            self.received += 1
            if self.drop_every and seq % self.drop_every == 1:
                self.dropped += 1
                continue
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self.replay_from(self.next_seq)
            if seq == self.next_seq:
                self.apply(seq, payload)

    def catch_up(self, seq: int | None) -> None:
        """Read until `seq` is applied; replay what the live stream did not bring."""
        deadline = time.monotonic() + 10
        while seq is not None and self.next_seq <= seq and time.monotonic() < deadline:
            self.pump(100)
            if self.next_seq <= seq and self.drop_every:
                self.replay_from(self.next_seq)
        assert seq is None or self.next_seq == seq + 1


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    args = ("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "3", "--max-model-len", "256")
    with WorkerProcess(demo_model_dir, *args, engine="sim") as w:
        yield w


async def _workload(url: str, rng: random.Random, n: int) -> list[list[int]]:
    prefixes = [[rng.randrange(10, 200) for _ in range(rng.randrange(16, 64))] for _ in range(4)]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(10, 200) for _ in range(rng.randrange(1, 60))]
        for _ in range(n)
    ]
    sem = asyncio.Semaphore(3)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(p: list[int]) -> None:
            async with sem:
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": "demo",
                        "prompt": p,
                        "max_tokens": rng.randrange(1, 12),
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one(p) for p in prompts))
    return prompts


def _snapshot(worker: WorkerProcess) -> dict:
    r = httpx.get(worker.url + "/kv/snapshot", timeout=10)
    assert r.status_code == 200
    return r.json()


def _snapshot_keys(snap: dict) -> Counter[bytes]:
    return Counter(bytes.fromhex(b["key"]) for b in snap["blocks"])


def test_live_late_and_lossy_subscribers_match_snapshot(worker):
    info = httpx.get(worker.url + "/kvgate/info").json()
    ctx = zmq.Context()
    try:
        live = Subscriber(ctx, worker)
        lossy = Subscriber(ctx, worker, drop_every=3)
        time.sleep(0.5)  # let the SUB subscriptions reach the PUB socket
        rng = random.Random(1234)
        prompts = asyncio.run(_workload(worker.url, rng, 40))
        live.pump()
        lossy.pump()

        late = Subscriber(ctx, worker)
        time.sleep(0.3)
        late.load_snapshot(_snapshot(worker))
        prompts += asyncio.run(_workload(worker.url, rng, 30))

        final = _snapshot(worker)
        for sub in (live, lossy, late):
            sub.catch_up(final["seq"])
        want = _snapshot_keys(final)
        assert live.removed > 0, "the workload should have forced evictions"
        assert 0 < len(want) <= NUM_BLOCKS
        assert live.keys == want
        assert late.keys == want
        assert lossy.keys == want
        assert lossy.dropped > 0 and lossy.replayed >= lossy.dropped
        assert live.topics == {f"kv@{info['instance_id']}@demo".encode()}

        # Snapshot order: parents before children, keys chained as cachekey computes them.
        all_keys = {b["key"] for b in final["blocks"]}
        seen: set[str] = set()
        for b in final["blocks"]:
            assert b["parent"] not in all_keys or b["parent"] in seen
            seen.add(b["key"])
        parts = info["fingerprint_parts"]
        ns = HashNamespace(parts["namespace_model"], parts["block_size"], parts["hash_seed"])
        last = block_keys(prompts[-1], ns)
        assert set(last) & set(want), "the most recent prompt's blocks should still be cached"

        # A reset clears everything and is one AllBlocksCleared event away from the snapshot.
        assert httpx.post(worker.url + "/reset_prefix_cache").json() == {"reset": True}
        cleared = _snapshot(worker)
        live.catch_up(cleared["seq"])
        assert live.cleared >= 1 and not live.keys and cleared["blocks"] == []
    finally:
        ctx.destroy(linger=0)


def test_replay_of_everything_from_zero_matches(worker):
    """A subscriber that missed the whole stream rebuilds it by replay alone."""
    asyncio.run(_workload(worker.url, random.Random(99), 10))
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, worker)
        snap = _snapshot(worker)
        sub.replay_from(0)
        assert sub.next_seq == snap["seq"] + 1
        assert sub.keys == _snapshot_keys(snap)
    finally:
        ctx.destroy(linger=0)


def test_a_steps_evictions_are_announced_before_its_forward_pass(demo_model_dir):
    """Evictions are final once a step is scheduled, so the worker publishes them before the
    step runs: a gateway routing during a long prefill must not count the blocks it took."""
    args = (
        "--num-blocks", "8", "--max-num-seqs", "2", "--max-model-len", "256",
        "--sim-prefill-s-per-token", "0.02",
    )  # fmt: skip
    with WorkerProcess(demo_model_dir, *args, engine="sim") as w:
        ctx = zmq.Context()
        try:
            sub = Subscriber(ctx, w)
            body = {"model": "demo", "max_tokens": 1, "temperature": 0}
            # 4 cached blocks, free once it ends; the next prompt needs 7 of the 8 blocks.
            r = httpx.post(f"{w.url}/v1/completions", json={**body, "prompt": [7] * 64}, timeout=30)
            assert r.status_code == 200, r.text
            done: list[float] = []

            def second() -> None:
                r = httpx.post(
                    f"{w.url}/v1/completions", json={**body, "prompt": [9] * 96}, timeout=30
                )
                assert r.status_code == 200, r.text
                done.append(time.monotonic())

            thread = threading.Thread(target=second)
            thread.start()
            deadline = time.monotonic() + 10
            while sub.removed == 0 and time.monotonic() < deadline:
                sub.pump(10)
            announced = time.monotonic()
            thread.join(30)
            assert sub.removed > 0 and done
            # Its prefill (96 tokens at 20 ms) runs after the announcement, not before it.
            assert done[0] - announced > 1.0, done[0] - announced
        finally:
            ctx.destroy(linger=0)
