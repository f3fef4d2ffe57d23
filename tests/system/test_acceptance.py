"""Acceptance with real clusters: hit rate vs round_robin and one big worker, adapter affinity
(both as `bench.hit_rate` and `bench.lora_affinity` measure them); worker SIGKILL."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from gateway.names import replica_name
from harness.cluster import Cluster, ClusterSpec
from harness.load import Tally, hold_one_per_worker
from harness.waits import wait_until
from tests.support.bench_runs import run_bench
from tests.support.chat import chat, user

pytestmark = pytest.mark.slow


def test_cache_aware_hit_rate_acceptance(tmp_path):
    # 12 groups with long system prompts; each worker's cache holds about a third of the
    # workload's ~2,600 distinct blocks (860 of them). One request at a time.
    args = ["--replicas", "4", "--policies", "cache_aware,round_robin", "--tenants", "12",
            "--num-blocks", "860", "--concurrency", "1", "--log-dir", str(tmp_path)]  # fmt: skip
    summary = run_bench("hit_rate", tmp_path / "hit_rate.json", *args)
    rows = {r["policy"]: r for r in summary["results"]}
    ca, rr, one = rows["cache_aware"], rows["round_robin"], rows["upper_bound"]
    assert ca["failed"] == rr["failed"] == one["failed"] == 0
    assert ca["requests"] == 108 and one["blocks_per_replica"] == 4 * 860
    assert ca["hit_rate"] >= 2 * rr["hit_rate"], (ca["hit_rate"], rr["hit_rate"])
    assert ca["hit_rate"] >= 0.9 * one["hit_rate"], (ca["hit_rate"], one["hit_rate"])
    assert ca["max_over_mean"] <= 1.5, ca["requests_per_replica"]
    assert len(ca["requests_per_replica"]) == 4 and min(ca["requests_per_replica"]) > 0
    assert ca["exact_predictions"] is not None and ca["exact_predictions"] >= 0.99
    assert one["exact_predictions"] is None  # no gateway in front of the upper bound


def test_adapter_affinity_loads_fewer_adapters_and_hits_more_than_round_robin(tmp_path):
    """4 workers with 2 adapter slots each, 8 adapters (bench.lora_affinity's defaults): the
    same trace through cache_aware and round_robin."""
    summary = run_bench("lora_affinity", tmp_path / "lora.json", "--log-dir", str(tmp_path))
    args = summary["args"]
    assert (args["replicas"], args["adapters"], args["max_loras"]) == ("4", "8", "2")
    assert args["policies"] == "cache_aware,round_robin" and args["runs"] == "1"
    rows = {r["policy"]: r for r in summary["results"]}
    ca, rr = rows["cache_aware"], rows["round_robin"]
    assert ca["failed"] == rr["failed"] == 0
    assert ca["requests"] == rr["requests"] == 96
    assert ca["adapter_loads"] < rr["adapter_loads"], (ca["adapter_loads"], rr["adapter_loads"])
    assert ca["hit_rate"] > rr["hit_rate"], (ca["hit_rate"], rr["hit_rate"])


async def _load(gateway: str, n: int, concurrency: int) -> list[httpx.Response | Exception]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int):
            body = {
                "model": "demo",
                "messages": [
                    {"role": "system", "content": f"Group {i % 5} assistant. " * 30},
                    {"role": "user", "content": f"question number {i}"},
                ],
                "max_tokens": 8,
            }
            async with sem:
                try:
                    return await client.post(f"{gateway}/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    return e

        return await asyncio.gather(*(one(i) for i in range(n)))


def _index(gateway: str) -> dict:
    return httpx.get(f"{gateway}/kvgate/index").json()["replicas"]


def test_sigkill_worker_under_load_loses_nothing_and_restart_reloads(tmp_path):
    spec = ClusterSpec(
        workers=3,
        engine="sim",
        num_blocks=512,
        gateway_args=("--poll-interval", "0.2", "--retries", "2"),
        worker_args=("--sim-prefill-s-per-token", "0.0002", "--sim-decode-s-per-step", "0.01"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        gw, victim = c.gateway_url, c.workers[0]
        wait_until(
            lambda: all(r["synced"] for r in _index(gw).values()), 15, "every replica synced"
        )
        old_instance = _index(gw)[victim.url]["instance_id"]

        async def run() -> tuple[Tally, list]:
            held = await hold_one_per_worker(gw, c.worker_urls)  # one is sure to need a retry
            load = asyncio.create_task(_load(gw, 60, 12))
            await asyncio.sleep(0.6)
            victim.kill(signal.SIGKILL)
            return await held, await load

        held, results = asyncio.run(run())
        assert held.ok == 3, (held.failed_reasons, held.lost_reasons)
        bad = [r for r in results if isinstance(r, Exception) or r.status_code != 200]
        assert not bad, bad[:3]
        served = {r.headers["x-kvgate-replica"] for r in results}
        assert len(served) >= 2
        metrics = httpx.get(f"{gw}/metrics").text.splitlines()
        retries = next(ln for ln in metrics if ln.startswith("kvgate_retries_total"))
        assert float(retries.split()[-1]) >= 1  # some requests did hit the dead worker
        wait_until(
            lambda: _index(gw)[victim.url]["blocks"] == 0, 15, "the killed worker's blocks dropped"
        )
        assert not _index(gw)[victim.url]["healthy"]

        victim.start()
        victim.wait_healthy(60)
        wait_until(
            lambda: _index(gw)[victim.url]["instance_id"] not in (None, old_instance),
            15,
            "the restarted worker's new instance",
        )
        wait_until(
            lambda: _index(gw)[victim.url]["synced"] and _index(gw)[victim.url]["healthy"],
            15,
            "the restarted worker synced",
        )
        # Traffic to the new instance is indexed again from its events.
        _chat_to(gw, victim.url)
        wait_until(lambda: _index(gw)[victim.url]["blocks"] > 0, 15, "its new blocks indexed")


def _chat_to(gateway: str, worker: str) -> None:
    """Send requests until one lands on `worker` (session hashing picks the replica)."""
    for i in range(64):
        headers = {"x-kvgate-routing-policy": "session", "x-session-id": f"s{i}"}
        r = chat(gateway, user("fresh conversation " * 10), headers, timeout=30)
        assert r.status_code == 200
        if r.headers["x-kvgate-replica"] == replica_name(worker, None):
            return
    raise AssertionError("no session hashed to the restarted worker")


def test_stream_broken_after_first_byte_ends_with_error_and_done(tmp_path):
    spec = ClusterSpec(
        workers=2,
        engine="sim",
        gateway_args=("--poll-interval", "0.2"),
        worker_args=("--sim-decode-s-per-step", "0.02"),
        log_dir=tmp_path,
        startup_timeout=60,
    )
    with Cluster(spec) as c:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.monotonic()
        with httpx.stream(
            "POST", f"{c.gateway_url}/v1/chat/completions", json=body, timeout=30
        ) as r:
            assert r.status_code == 200
            serving = next(w for w in c.workers if w.url == c.served_by(r))
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert '"choices"' in first
            serving.kill(signal.SIGKILL)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert time.monotonic() - t0 < 20
        assert rest[-1] == "data: [DONE]"
        assert any('"error"' in ln for ln in rest[:-1])
