"""Adapter affinity (pure parts): the miss score, cache_aware weighing it against prefix hits and
load, and what the gateway reads from plain vLLM workers (/v1/models, vllm:lora_requests_info)."""

from __future__ import annotations

from cachekey.documents import LoRAAdapters
from cachekey.keys import HashNamespace, block_keys
from gateway.config import GatewayConfig
from gateway.fleet.replica import Replica
from gateway.fleet.vllm_compat import lora_adapters, parse_lora_info, parse_models
from gateway.names import ReplicaId
from gateway.routing.adapters import FULL, RESIDENT, ROOM, adapter_miss, note_routed
from gateway.routing.policies import POLICIES, RouteContext

NS = HashNamespace("demo", 16)
TTL = 2.0


def replica(i: int, resident: list[str], max_loras: int = 2) -> Replica:
    rep = Replica(ReplicaId(f"http://w{i}"), f"http://w{i}", healthy=True)
    rep.lora = LoRAAdapters(max_loras=max_loras, adapters=["a", "b", "c"], resident=resident)
    return rep


def rank(reps: list[Replica], lora: str, tokens: list[int], matched=None) -> list[Replica]:
    keys = block_keys(tokens, NS, lora_name=lora)
    ctx = RouteContext(reps, keys, len(tokens), 16, matched or {}, {}, keys[0], lora)
    return POLICIES["cache_aware"](GatewayConfig()).rank(ctx)


def test_miss_is_resident_then_room_then_full():
    assert adapter_miss(replica(0, ["a"]), "a", 0.0, TTL) == RESIDENT
    assert adapter_miss(replica(0, ["a"]), "b", 0.0, TTL) == ROOM
    assert adapter_miss(replica(0, ["a", "c"]), "b", 0.0, TTL) == FULL


def test_an_adapter_just_routed_counts_as_resident_until_the_ttl():
    rep = replica(0, [])
    note_routed(rep, "a", 10.0, TTL)
    note_routed(rep, "b", 10.5, TTL)
    assert adapter_miss(rep, "a", 11.0, TTL) == RESIDENT
    assert adapter_miss(rep, "c", 11.0, TTL) == FULL  # a and b take both slots
    assert adapter_miss(rep, "a", 12.1, TTL) == ROOM  # forgotten: the poll says what is there
    note_routed(rep, "c", 13.0, TTL)
    assert set(rep.lora_routed) == {"c"}


def test_cache_aware_prefers_the_replica_holding_the_adapter():
    reps = [replica(0, ["b", "c"]), replica(1, []), replica(2, ["a"]), replica(3, ["b"])]
    tokens = list(range(100, 164))
    assert rank(reps, "a", tokens)[0] is reps[2]  # resident
    assert rank(reps, "c", tokens)[0] is reps[0]
    reps[2].lora = LoRAAdapters(max_loras=2, adapters=["a"], resident=["b", "c"])
    assert rank(reps, "a", tokens)[0] in (reps[1], reps[3])  # a free slot beats evicting
    assert rank(reps, "a", tokens)[-1] in (reps[0], reps[2])


def test_prefix_hits_and_load_are_weighed_against_affinity():
    reps = [replica(0, ["a"]), replica(1, ["b", "c"])]
    tokens = list(range(100, 740))  # 40 blocks
    assert rank(reps, "a", tokens)[0] is reps[0]
    # 30 cached blocks of this prompt (under this adapter) on the full replica: still a load.
    assert rank(reps, "a", tokens, {reps[1].id: 30})[0] is reps[0]
    # 38 outweigh it (the adapter miss costs --lora-weight, 32 blocks).
    assert rank(reps, "a", tokens, {reps[1].id: 38})[0] is reps[1]
    # A deep queue on the replica holding the adapter sends the request to load it elsewhere.
    reps[0].waiting = 10
    reps[0].count_foreign()  # as a poll does
    assert rank(reps, "a", tokens)[0] is reps[1]


def test_vllm_models_list_the_base_and_its_adapters():
    body = {
        "data": [
            {"id": "llama", "parent": None, "root": "/m"},
            {"id": "sql", "parent": "llama", "root": "/a/sql"},
            {"id": "chat", "parent": "llama", "root": "/a/chat"},
        ]
    }
    assert parse_models(body) == ("llama", ["sql", "chat"])
    assert parse_models({"data": [{"id": "old-vllm"}]}) == ("old-vllm", [])  # no parent field
    assert parse_models({"data": []}) is None
    assert parse_models({"object": "error"}) is None


def test_vllm_lora_metric_latest_sample_wins():
    text = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",'
        'waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat,sql",'
        'waiting_lora_adapters="math"} 1.8e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.75e9\n'
    )
    assert parse_lora_info(text) == (2, ["chat", "sql", "math"])
    assert parse_lora_info("vllm:num_requests_waiting 0\n") is None
    lora = lora_adapters(["sql", "chat"], text)
    assert lora == LoRAAdapters(max_loras=2, adapters=["sql", "chat"], resident=["chat", "sql"])
    assert lora_adapters([], text) is None
    unknown = lora_adapters(["sql"], "")
    assert unknown is not None and unknown.resident == []
