"""The host KV tier seen from outside a live sim worker: its CPU-tier BlockStored/BlockRemoved on
the real ZMQ stream (replayed from its first batch over the DEALER socket, so a late SUB join
loses nothing), in order around the GPU's events; a host hit in the usage; /metrics."""

from __future__ import annotations

import re
from collections import defaultdict

import httpx
import zmq

from cachekey.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_replay_reply,
    seq_bytes,
)
from tests.support.worker_harness import WorkerProcess
from worker.engine.sim_presets import preset

PER_BLOCK = 16 * 32768  # h200-llama-1b: 32 KiB of K/V per token, 16 tokens a block


class TierReplica:
    """What a tier-aware gateway learns from the events: each tier's keys, and each key's
    history of (event, medium) in stream order."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {"GPU": set(), "CPU": set()}
        self.history: dict[bytes, list[str]] = defaultdict(list)
        self.next_seq = 0

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, "a gap in the live stream"
        self.next_seq = seq + 1
        for ev in decode_batch(payload).events:
            assert not isinstance(ev, AllBlocksCleared)
            medium = ev.medium or "GPU"
            held = self.tiers[medium]
            for key in ev.block_hashes:
                assert isinstance(key, bytes)
                if isinstance(ev, BlockStored):
                    assert key not in held, f"{medium} stored twice"
                    held.add(key)
                    self.history[key].append(f"stored {medium}")
                else:
                    assert isinstance(ev, BlockRemoved) and key in held, f"{medium} removed"
                    if medium == "GPU":  # its K/V went to host memory first
                        assert key in self.tiers["CPU"]
                    held.discard(key)
                    self.history[key].append(f"removed {medium}")


def complete(w: WorkerProcess, prompt: list[int]) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{w.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def replay_all(ctx: zmq.Context, w: WorkerProcess, replica: TierReplica) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{w.replay_port}")
    dealer.send_multipart([b"", seq_bytes(0)])
    while True:
        assert dealer.poll(5000), "no replay answer"
        item = parse_replay_reply(dealer.recv_multipart())
        if item is None:
            return
        replica.apply(*item)


def metric(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


TIERED = (
    "--num-blocks", "8", "--max-num-seqs", "1", "--max-model-len", "256",
    "--sim-preset", "h200-llama-1b", "--sim-server-scale", "0",
    "--kv-offload-bytes", str(4 * PER_BLOCK),
)  # fmt: skip


def embed(w: WorkerProcess, tokens: list[int]) -> dict:
    r = httpx.post(f"{w.url}/v1/embeddings", json={"model": "demo", "input": tokens}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_cpu_tier_events_in_order_and_a_host_hit(demo_model_dir) -> None:
    with WorkerProcess(demo_model_dir, *TIERED, engine="sim") as w:
        a = [7] * 64  # 4 cached blocks; 63 prompt tokens usable as a hit: 3 blocks
        complete(w, a)
        complete(w, [9] * 112)  # 7 of the 8 GPU blocks: a's last three go to host memory
        # a0 from the GPU, a1 and a2 copied back (a3 is computed: a hit leaves a token to
        # compute); the blocks this takes from [9] go to host memory, whose LRU drops a3 (a1
        # and a2 are locked by the load), then [9]'s block 6.
        again = complete(w, a)
        metrics = httpx.get(f"{w.url}/metrics", timeout=10).text
        ctx = zmq.Context()
        try:
            replica = TierReplica()
            replay_all(ctx, w, replica)
        finally:
            ctx.destroy(linger=0)
    histories = list(replica.history.values())
    sg, sc, rg, rc = "stored GPU", "stored CPU", "removed GPU", "removed CPU"
    a0, a1, a2, a3, *n = histories
    assert a0 == [sg]
    assert a1 == a2 == [sg, sc, rg, sg]  # copied out, evicted, copied back (stored again)
    assert a3 == [sg, sc, rg, rc, sg]  # copied out, evicted, dropped by the host LRU, computed
    # [9]'s blocks 0-3 stay on the GPU; 4-6 went to host memory, where the LRU dropped the
    # tail of the chain 5-6 (a chain's tail goes before its head).
    assert n[:4] == [[sg]] * 4 and n[4] == n[5] == [sg, sc, rg] and n[6] == [sg, sc, rg, rc]
    # Every block that left the GPU went to host memory first.
    for history in histories:
        if rg in history:
            assert history.index(sc) < history.index(rg), history
    assert again["prompt_tokens_details"]["cached_tokens"] == 48
    assert again["prompt_tokens_details"]["cpu_cached_tokens"] == 32  # of them, the host's
    assert metric(metrics, "vllm:external_prefix_cache_hits_total") == 32
    assert metric(metrics, "kvgate_worker_prefix_cache_tier_hits_total", 'medium="CPU"') == 32
    assert metric(metrics, "kvgate_worker_prefix_cache_tier_hits_total", 'medium="GPU"') == 16
    assert metric(metrics, "vllm:kv_offload_total_bytes_total", "CPU_to_GPU") == 2 * PER_BLOCK
    assert metric(metrics, "vllm:kv_offload_total_bytes_total", "GPU_to_CPU") == 6 * PER_BLOCK
    assert metric(metrics, "vllm:kv_offload_cpu_cache_usage_perc") == 1.0
    # The two blocks' copy back, as the sim charged it (time scale 1): vLLM's load time.
    charged = preset("h200-llama-1b").host_load(32)
    assert charged > 0 and abs(metric(metrics, "vllm:kv_offload_load_time_total") - charged) < 1e-9


def test_embeddings_say_the_host_tiers_share_as_completions_do(demo_model_dir) -> None:
    """The same three prompts as above, embedded: the usage splits the hit by tier alike (the
    gateway checks its per-tier prediction against it)."""
    with WorkerProcess(demo_model_dir, *TIERED, engine="sim") as w:
        first = embed(w, [7] * 64)
        assert first["prompt_tokens_details"] == {"cached_tokens": 0, "cpu_cached_tokens": 0}
        embed(w, [9] * 112)
        again = embed(w, [7] * 64)
    # As the completion above: a0 from the GPU, a1 and a2 copied back from host memory.
    assert again["prompt_tokens_details"] == {"cached_tokens": 48, "cpu_cached_tokens": 32}
