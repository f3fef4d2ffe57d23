"""The hidden-state benchmarks' plumbing: the prompts they build share what they claim, both
engines return the same embeddings, and the routing run counts what the workers count."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from bench import embedding_routing as er
from bench import hidden_prefill as hp
from harness.cluster import Cluster, ClusterSpec


def shared_prefix(prompts) -> int:
    first = prompts[0].token_ids
    return min(
        next((i for i, (a, b) in enumerate(zip(first, p.token_ids, strict=False)) if a != b), 0)
        for p in prompts[1:]
    )


def test_prompts_share_their_prefix(demo_model_dir: Path) -> None:
    engine = hp.make_engine(str(demo_model_dir), num_blocks=16)
    rng = random.Random(0)
    text = hp.text_prompts(4, 600, 0.9, rng)
    images = hp.image_prompts(engine, 4, 600, 0.9, rng)
    assert [len(p) for p in text] == [600] * 4 and shared_prefix(text) == 540
    assert all(600 <= len(p) < 620 and len(p.mm_items) == 4 for p in images)
    assert shared_prefix(images) >= 0.85 * 600
    assert all(item.end <= shared_prefix(images) for item in images[0].mm_items)


def test_prefill_round_compares_equal_embeddings(demo_model_dir: Path) -> None:
    prompts = hp.text_prompts(3, 300, 0.9, random.Random(1))
    hot, cold, kv, diff, hit_rate = hp.prefill_round(
        str(demo_model_dir), prompts, time.perf_counter
    )
    assert len(hot) == len(cold) == len(kv) == 3 and diff <= 1e-4
    assert hit_rate == pytest.approx(2 * 256 / 900)  # the 2nd and 3rd hit 16 full blocks


def test_routing_run_counts_like_the_workers(tmp_path: Path) -> None:
    trace = er.make_trace(groups=4, per_group=3, prefix_words=120, seed=0)
    assert trace == er.make_trace(groups=4, per_group=3, prefix_words=120, seed=0)
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        num_blocks=256,
        worker_args=("--hidden-state-cache",),
        gateway_args=("--poll-interval", "0.2"),
        log_dir=tmp_path,
    )
    with Cluster(spec) as cluster:
        row = er.run_policy(cluster, trace, "cache_aware", concurrency=1)
    assert row.requests == 12 and row.failed == 0
    assert row.exact_predictions == 1.0
    assert row.hit_rate > 0.5
    assert row.worker_hidden_hit_rate == pytest.approx(row.hit_rate, abs=1e-9)
