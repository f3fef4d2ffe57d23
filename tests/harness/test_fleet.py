"""The simulated fleet (harness/fleet): each replica's HTTP API, cache and KV events on real
sockets, and a small fleet behind real gateway processes: predictions equal the replicas' reported
cached tokens, and every gateway's index equals the replicas' caches."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from cachekey.documents import Snapshot, WorkerInfo, decode_document
from cachekey.events import BlockRemoved, BlockStored, decode_batch, parse_replay_reply, seq_bytes
from cachekey.events import seq_from_bytes as seq_of
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId
from harness.cluster import ClusterSpec
from harness.fleet.engine import Timing
from harness.fleet.fleet import Fleet, FleetConfig
from harness.fleet.process import FleetCluster, FleetSpec
from harness.prom import metric_total
from harness.waits import index_mismatches, snapshot_digest, wait_until

FAST = Timing(prefill_s_per_token=0.0, decode_s_per_step=0.0, step_s=0.0)


def _chat(i: int, words: int = 70) -> dict:
    """A prompt whose start is unique to `i`: 156 tokens (9 full blocks) for 70 words."""
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": f"prompt {i} " + "cache block " * words}],
        "max_tokens": 2,
    }


async def _events(sub: zmq.asyncio.Socket, n: int) -> list[tuple[int, list]]:
    out = []
    for _ in range(n):
        frames = await asyncio.wait_for(sub.recv_multipart(), 10)
        out.append((seq_of(frames[1]), decode_batch(frames[2]).events))
    return out


def test_replica_caches_evicts_publishes_and_replays():
    async def run() -> None:
        config = FleetConfig(replicas=2, num_blocks=20, timing=FAST)
        async with Fleet(config) as fleet, httpx.AsyncClient(timeout=10) as client:
            rep, url = fleet.replicas[0], fleet.urls[0]
            info = decode_document((await client.get(f"{url}/kvgate/info")).content, WorkerInfo)
            assert info.kv_events.port == rep.events.port and info.defers_shared_prefill
            ctx = zmq.asyncio.Context()
            sub = ctx.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{info.kv_events.port}")
            sub.subscribe(info.kv_events.topic.encode())
            await asyncio.sleep(0.3)  # the subscription reaches the PUB
            usage = []
            # 10 of the 20 blocks each (9 full, the rest and the output): 0 and 1 fill the
            # cache, 0 again hits its 9 blocks, 2 evicts 1's (the least recently used).
            for i in (0, 1, 0, 2):
                r = await client.post(f"{url}/v1/chat/completions", json=_chat(i))
                assert r.status_code == 200, r.text
                usage.append(r.json()["usage"])
            assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 0, 144, 0]
            batches = await _events(sub, 4)
            assert [s for s, _ in batches] == [0, 1, 2, 3]
            kinds = [type(e) for _, events in batches for e in events]
            assert kinds == [BlockStored, BlockStored, BlockRemoved, BlockStored]
            removed = batches[2][1][0].block_hashes
            assert removed == list(reversed(batches[1][1][0].block_hashes))
            # Replay from seq 1: the same batches, then the end marker.
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{info.kv_events.replay_port}")
            await dealer.send_multipart([b"", seq_bytes(1)])
            replayed = []
            while (item := parse_replay_reply(await dealer.recv_multipart())) is not None:
                replayed.append(item[0])
            assert replayed == [1, 2, 3]
            # The snapshot is what the events say the cache holds.
            index = BlockIndex()
            for _, events in batches:
                index.apply(ReplicaId("r"), fleet.model.namespace, events)
            snap = decode_document((await client.get(f"{url}/kv/snapshot")).content, Snapshot)
            assert snap.seq == 3 and len(snap.blocks) == index.lookup.replica_blocks(ReplicaId("r"))
            digest, _ = await asyncio.to_thread(snapshot_digest, url)
            assert digest == index.lookup.replica_digest(ReplicaId("r"))
            # The other replica saw nothing.
            other = await client.get(f"{fleet.urls[1]}/kv/snapshot")
            assert decode_document(other.content, Snapshot).blocks == []
            sub.close(0)
            dealer.close(0)
            ctx.term()

    asyncio.run(run())


def test_replica_answers_like_a_worker():
    async def run() -> None:
        config = FleetConfig(replicas=1, num_blocks=20, timing=FAST)
        async with Fleet(config) as fleet, httpx.AsyncClient(timeout=10) as client:
            url = fleet.urls[0]
            body = {**_chat(0, 10), "stream": True, "stream_options": {"include_usage": True}}
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            lines = [ln for ln in r.text.split("\n\n") if ln]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]"
            chunks = [msgspec.json.decode(ln[6:]) for ln in lines[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == 2
            r = await client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.json()["usage"]["completion_tokens"] == 3
            metrics = (await client.get(f"{url}/metrics")).text
            assert 'vllm:prompt_tokens_total{model_name="demo",engine="0"}' in metrics
            for bad, status, param in (
                (b"{not json", 400, None),
                (b"[1]", 400, None),
                (b'{"model": "other", "messages": []}', 404, "model"),
                (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, None),
                (b'{"messages": "x"}', 400, "messages"),
                (msgspec.json.encode(_chat(1, 40) | {"max_tokens": 300}), 400, "max_tokens"),
            ):
                r = await client.post(f"{url}/v1/chat/completions", content=bad)
                assert r.status_code == status, (bad, r.text)
                assert r.json()["error"]["param"] == param or param is None, r.text
            r = await client.get(f"{url}/nowhere")
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
            assert (await client.post(f"{url}/reset_prefix_cache")).json() == {"reset": True}

    asyncio.run(run())


@pytest.mark.slow
def test_small_fleet_behind_two_gateways_predicts_exactly(tmp_path):
    # 8 replicas of 64 blocks: a tenant's conversations (~30 blocks each) evict one another.
    # Each request is sent once both gateways' indexes equal the replicas' caches, so every
    # prediction must equal the cached tokens the replica reports, evictions included.
    spec = ClusterSpec(
        workers=0, gateways=2, gateway_args=("--poll-interval", "0.2"), log_dir=tmp_path
    )
    fleet = FleetSpec(replicas=8, num_blocks=64, timing=Timing(0.0001, 0.001, 0.001))
    with FleetCluster(spec, fleet) as c, httpx.Client(timeout=30) as client:
        urls, gateways = c.worker_urls, [g.url for g in c.gateways]
        assert len(urls) == 8

        def converged(gateway: str):
            return lambda: not index_mismatches(gateway, urls, client=client)

        computed: dict[str, int] = {}
        exact = 0
        for i in range(48):
            for g in gateways:
                wait_until(converged(g), 15, "the index to converge")
            tenant, user = i % 12, i // 12
            body = {
                "model": "demo",
                "messages": [
                    {"role": "system", "content": f"Tenant {tenant}. " + "policy queue " * 150},
                    {"role": "user", "content": f"user {user} asks " + "why " * 20},
                ],
                "max_tokens": 4,
            }
            r = client.post(f"{gateways[i % 2]}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt = r.json()["usage"]["prompt_tokens"]
            exact += int(r.headers["x-kvgate-predicted-cached-tokens"]) == cached
            name = r.headers["x-kvgate-replica"]
            computed[name] = computed.get(name, 0) + (prompt - cached) // 16
        assert exact == 48
        assert max(computed.values()) > 64, computed  # some replica evicted blocks
        for g in gateways:
            wait_until(converged(g), 15, "the index to converge")


@pytest.mark.slow
def test_a_frozen_host_drops_no_index_below_the_failed_polls_limit(tmp_path):
    # The whole fleet stops answering for 1.5 s (SIGSTOP), as an overloaded host can: every
    # poll in that window times out (1 s). A gateway that marks a worker down at its first
    # unanswered poll drops and reloads every index; one that waits for 5 in a row drops none.
    spec = ClusterSpec(workers=0, gateways=0, log_dir=tmp_path)
    fleet = FleetSpec(replicas=4, num_blocks=64, timing=Timing(0.0, 0.0, 0.0))
    common = ("--poll-interval", "0.2", "--connect-timeout", "0.5")
    with FleetCluster(spec, fleet) as c, httpx.Client(timeout=30) as client:
        urls = c.worker_urls
        eager, patient = c.make_gateway(0), c.make_gateway(1)
        eager.args += [*common, "--down-after-failed-polls", "1"]
        patient.args += [*common, "--down-after-failed-polls", "5"]
        c.gateways = [eager, patient]
        for g in c.gateways:
            g.start()
        for g in c.gateways:
            g.wait_healthy(60)
        for g in c.gateways:
            wait_until(
                lambda g=g: not index_mismatches(g.url, urls, client=client), 15, "converged"
            )
        resyncs = {g.name: metric_total(g.url, "kvgate_event_resyncs_total") for g in c.gateways}
        assert c.fleet is not None and c.fleet.pid is not None
        os.kill(c.fleet.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(c.fleet.pid, signal.SIGCONT)
        for g in c.gateways:  # both end up with every replica healthy and indexed again
            wait_until(
                lambda g=g: not index_mismatches(g.url, urls, client=client), 20, "converged"
            )
        after = {g.name: metric_total(g.url, "kvgate_event_resyncs_total") for g in c.gateways}
        assert after[patient.name] == resyncs[patient.name]
        assert after[eager.name] >= resyncs[eager.name] + len(urls)  # each replica reloaded
