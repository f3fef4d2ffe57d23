"""The worker documents (cachekey.documents): typed on both sides, and a malformed one is a clear,
logged error in the gateway instead of a KeyError. Real HTTP servers stand in for a worker whose
documents are broken; tests/worker/server/test_compat.py reads a real worker's."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
import zmq.asyncio

from cachekey import DEFAULT_HASH_SEED, HashNamespace, MMItem, block_keys
from cachekey.documents import (
    AssetFiles,
    DocumentError,
    KVEventsEndpoint,
    RankInfo,
    Snapshot,
    SnapshotBlock,
    WorkerInfo,
    decode_document,
    encode_document,
)
from cachekey.keys import block_extra_keys
from gateway.config import GatewayConfig
from gateway.events.event_source import EventSource
from gateway.events.subscriber import KVEventSubscriber
from gateway.fleet.replica import Replica
from gateway.fleet.replica_set import ReplicaSet
from gateway.index.block_index import BlockIndex
from gateway.metrics import GatewayMetrics
from gateway.names import ReplicaId
from harness.ports import free_port

INFO = {
    "model": "demo",
    "block_size": 4,
    "hash_seed": DEFAULT_HASH_SEED,
    "instance_id": "inst1",
    "kv_events": {"enabled": False, "port": None, "replay_port": None, "topic": ""},
}


def test_info_round_trips_and_names_the_namespace() -> None:
    info = decode_document(json.dumps(INFO), WorkerInfo)
    assert info.namespace() == HashNamespace("demo", 4, DEFAULT_HASH_SEED)
    assert info.has_snapshot and info.fingerprint is None
    assert decode_document(encode_document(info), WorkerInfo) == info
    extra = decode_document(json.dumps({**INFO, "added_later": [1, 2]}), WorkerInfo)
    assert extra == info  # unknown fields are ignored: a newer worker may add some


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": None}, "Expected `str`, got `null` - at `$.model`"),
        ({"block_size": 0}, "Expected `int` >= 1 - at `$.block_size`"),
        ({"block_size": "16"}, "Expected `int`, got `str` - at `$.block_size`"),
        ({"kv_events": {"enabled": True, "port": 70000}}, "at `$.kv_events.port`"),
        ({"hash_seed": ...}, "Object missing required field `hash_seed`"),
    ],
)
def test_malformed_info_names_the_field(change: dict, message: str) -> None:
    doc = {k: v for k, v in {**INFO, **change}.items() if v is not ...}
    with pytest.raises(DocumentError) as err:
        decode_document(json.dumps(doc), WorkerInfo)
    assert str(err.value).startswith("malformed /kvgate/info document: ")
    assert message in str(err.value)


def test_snapshot_blocks_index_to_the_keys_the_gateway_computes() -> None:
    """Blocks with a salt and an image span, as a worker writes them, give the same keys as
    cachekey.block_keys over the prompt (the gateway's own prediction)."""
    ns = HashNamespace("demo", 4)
    tokens = list(range(10, 22))
    image = MMItem("img-1", "image", offset=2, length=5)
    keys = block_keys(tokens, ns, [image], cache_salt="s")
    blocks, parent = [], None
    for i, key in enumerate(keys):
        extra = block_extra_keys(i, 4, [image], cache_salt="s")
        blocks.append(SnapshotBlock(key.hex(), parent, tokens[i * 4 : i * 4 + 4], extra))
        parent = key.hex()
    wire = encode_document(Snapshot(instance_id="i", seq=7, block_size=4, blocks=blocks))
    assert b'"extra_keys":[["img-1",2],"s"]' in wire  # [identifier, offset] pairs and strings
    snap = decode_document(wire, Snapshot)
    index, replica = BlockIndex(), ReplicaId("w")
    assert all(index.store(replica, ns, ev) for ev in snap.stored_events())
    assert index.lookup.match(keys, [replica])[replica] == 3


def test_snapshot_host_blocks_apply_to_the_host_tier_parents_first() -> None:
    """A snapshot's host-tier blocks become `medium: "CPU"` stores, each after its parent in
    either tier (here the GPU's block 2 hangs under a block only the host tier holds); a
    document without `host_blocks` (an older worker) still decodes, with none."""
    ns = HashNamespace("demo", 4)
    tokens = list(range(10, 22))
    keys = block_keys(tokens, ns)
    blocks = [
        SnapshotBlock(k.hex(), keys[i - 1].hex() if i else None, tokens[i * 4 : i * 4 + 4])
        for i, k in enumerate(keys)
    ]
    doc = Snapshot(
        instance_id="i", seq=3, block_size=4, blocks=[blocks[0], blocks[2]], host_blocks=blocks
    )
    events = list(decode_document(encode_document(doc), Snapshot).stored_events())
    order = [(ev.block_hashes[0], ev.medium) for ev in events]
    assert order.index((keys[1], "CPU")) < order.index((keys[2], "GPU"))
    gpu = [(keys[0], "GPU"), (keys[2], "GPU")]
    assert sorted(order) == sorted(gpu + [(k, "CPU") for k in keys])
    index, replica = BlockIndex(), ReplicaId("w")
    assert all(index.store(replica, ns, ev) for ev in events)
    assert index.lookup.replica_blocks(replica, host=True) == 3
    gpu: dict = {}  # the GPU's hit stops at block 1, which the host tier holds: all three hit
    assert index.lookup.hits(keys, gpu=gpu) == {replica: 3} and gpu == {replica: 1}
    old = json.dumps({"instance_id": "i", "seq": 0, "block_size": 4, "blocks": []})
    assert decode_document(old, Snapshot).host_blocks == []


def test_malformed_snapshot_and_assets_name_the_field() -> None:
    block = {"key": "0a0", "parent": None, "token_ids": [1, 2, 3, 4]}
    doc = {"instance_id": "i", "seq": 0, "block_size": 4, "blocks": [block]}
    with pytest.raises(DocumentError, match=r"/kv/snapshot .* at `\$\.blocks\[0\]\.key`"):
        decode_document(json.dumps(doc), Snapshot)
    with pytest.raises(DocumentError, match=r"/kvgate/assets document: Invalid base64"):
        decode_document(b'{"files": {"a": "not base64!"}}', AssetFiles)
    assert decode_document(b'{"files": {"a": "eHl6"}}', AssetFiles).files == {"a": b"xyz"}


class FakeWorker:
    """A real HTTP server answering /kvgate/info, /health, /metrics and /kv/snapshot with
    whatever bodies the test sets."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {"/health": b"", "/metrics": b""}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = outer.bodies.get(self.path)
                self.send_response(404 if body is None else 200)
                self.send_header("content-length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_gateway_refuses_malformed_info_with_one_clear_log_line(caplog) -> None:
    worker = FakeWorker()

    async def main() -> None:
        async with httpx.AsyncClient() as http:
            replicas = ReplicaSet(GatewayConfig(), BlockIndex(), GatewayMetrics(), http)
            rep = Replica(id=ReplicaId(worker.url), url=worker.url)
            try:
                worker.bodies["/kvgate/info"] = json.dumps({**INFO, "block_size": "x"}).encode()
                with caplog.at_level(logging.ERROR, logger="gateway.fleet.replica_set"):
                    for _ in range(3):
                        await replicas.poll_once(rep)
                assert not rep.healthy and rep.info is None and rep.namespace is None
                (record,) = [r for r in caplog.records if r.name == "gateway.fleet.replica_set"]
                assert worker.url in record.getMessage()
                assert "malformed /kvgate/info document" in record.getMessage()
                assert "at `$.block_size`" in record.getMessage()
                worker.bodies["/kvgate/info"] = json.dumps(INFO).encode()
                await replicas.poll_once(rep)
                assert rep.healthy and rep.instance_id == "inst1" and rep.health.info_error is None
                assert rep.namespace == HashNamespace("demo", 4, DEFAULT_HASH_SEED)
            finally:
                await replicas.close()

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_subscriber_refuses_a_malformed_snapshot() -> None:
    worker = FakeWorker()
    bad_block = {"key": "zz", "parent": None, "token_ids": [1, 2, 3, 4]}
    worker.bodies["/kv/snapshot"] = json.dumps(
        {"instance_id": "inst1", "seq": 3, "block_size": 4, "blocks": [bad_block]}
    ).encode()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        source = EventSource(
            "inst1", "127.0.0.1", free_port(), None, "", worker.url + "/kv/snapshot"
        )
        index = BlockIndex()
        async with httpx.AsyncClient() as http:
            sub = KVEventSubscriber(
                ReplicaId(worker.url), source, HashNamespace("demo", 4), index, http, ctx,
                GatewayMetrics(),
            )  # fmt: skip
            with pytest.raises(DocumentError, match=r"at `\$\.blocks\[0\]\.key`"):
                await sub.resync(current_seq=None)
            assert index.stats().copies == 0 and sub.next_seq == 0
        ctx.term()

    try:
        asyncio.run(main())
    finally:
        worker.close()


def _vllm_info(models: dict, metrics: str, config: GatewayConfig) -> WorkerInfo | None:
    from gateway.fleet.vllm_compat import vllm_info

    worker = FakeWorker()
    worker.bodies["/v1/models"] = json.dumps(models).encode()

    async def main() -> WorkerInfo | None:
        async with httpx.AsyncClient() as http:
            return await vllm_info(http, worker.url, metrics, config)

    try:
        return asyncio.run(main())
    finally:
        worker.close()


def test_plain_vllm_info_is_a_worker_info_without_snapshot() -> None:
    from gateway.names import VLLM_INSTANCE

    models = {"data": [{"id": "llava", "max_model_len": 4096}]}
    metrics = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="9"} 1.0\n'
    config = GatewayConfig(vllm_kv_events_port=5557, vllm_kv_events_topic="kv")
    events = KVEventsEndpoint(enabled=True, port=5557, replay_port=None, topic="kv")
    assert _vllm_info(models, metrics, config) == WorkerInfo(
        model="llava",
        block_size=32,
        hash_seed=DEFAULT_HASH_SEED,
        instance_id=VLLM_INSTANCE,
        has_snapshot=False,
        engine="vllm",
        mm_match_rule="partial",  # vLLM keeps a match that ends inside an image
        defers_shared_prefill=True,  # a sibling hits a prefix vLLM has scheduled, computed or not
        max_model_len=4096,
        num_blocks=9,  # num_gpu_blocks: what a request's prompt would evict there
        data_parallel_rank=0,
        kv_events=events,
        data_parallel_ranks=[RankInfo(rank=0, kv_events=events, num_blocks=9)],
    )


def test_plain_vllm_info_of_two_engines_has_two_ranks_on_offset_ports() -> None:
    """vLLM's `engine` labels name the ranks; each publishes on the base ports + its rank."""
    metrics = (
        'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
    )
    config = GatewayConfig(
        vllm_kv_events_port=5557, vllm_kv_events_replay_port=5600, vllm_kv_events_topic="kv"
    )
    info = _vllm_info({"data": [{"id": "m", "max_model_len": 0}]}, metrics, config)
    assert info is not None and info.max_model_len is None  # 0 is no length
    assert info.data_parallel_rank is None and not info.kv_events.enabled
    ranks = [(r.rank, r.kv_events.port, r.kv_events.replay_port) for r in info.data_parallel_ranks]
    assert ranks == [(0, 5557, 5600), (1, 5558, 5601)]


def test_each_rank_of_a_worker_carries_its_host_tiers_size_to_its_slot() -> None:
    """A kvgate worker with a host tier says its size per rank (`--kv-offload-blocks`); a
    plain vLLM worker says none, so the gateway prices its GPU's evictions as lost."""
    from gateway.fleet.ranks import rank_slots

    events = KVEventsEndpoint(enabled=True, port=5557, replay_port=5600, topic="kv")
    ranks = [RankInfo(rank=r, kv_events=events, num_blocks=64, host_num_blocks=256) for r in (0, 1)]
    info = WorkerInfo(
        model="m", block_size=16, hash_seed="0", instance_id="i", kv_events=events,
        num_blocks=64, host_num_blocks=256, data_parallel_ranks=ranks,
    )  # fmt: skip
    again = decode_document(msgspec.json.encode(info), WorkerInfo)
    assert [(s.num_blocks, s.host_num_blocks) for s in rank_slots(again)] == [(64, 256)] * 2
    (one,) = rank_slots(msgspec.structs.replace(again, data_parallel_ranks=[]))
    assert one.host_num_blocks == 256
    metrics = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="9"} 1.0\n'
    plain = _vllm_info({"data": [{"id": "m"}]}, metrics, GatewayConfig())
    assert plain is not None and [s.host_num_blocks for s in rank_slots(plain)] == [None]
