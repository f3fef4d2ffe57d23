"""A kvgate worker serving two data-parallel ranks behind one URL (`--data-parallel-size 2`)
looks to the gateway as a vLLM server with two engines does: two replicas, each indexed from its
own events on its own ports, loaded from its own `engine` label, and named by
`X-data-parallel-rank`. Real worker and gateway processes, real HTTP and ZMQ."""

from __future__ import annotations

import re
import time

import httpx
from conftest import free_port
from vllm_like import free_port_run
from worker_harness import WorkerProcess

from bench.cluster import Proc, wait_index_converged


def chat(text: str) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def test_two_rank_kvgate_worker_behind_the_gateway(tmp_path, demo_model_dir):
    ev, rp = free_port_run(2), free_port_run(2)
    port_args = ("--kv-events-port", str(ev), "--kv-events-replay-port", str(rp))
    with WorkerProcess(demo_model_dir, "--data-parallel-size", "2", *port_args) as w:
        info = httpx.get(f"{w.url}/kvgate/info").json()
        ranks = info["data_parallel_ranks"]
        ports = [(r["rank"], r["kv_events"]["port"], r["kv_events"]["replay_port"]) for r in ranks]
        assert ports == [(0, ev, rp), (1, ev + 1, rp + 1)]
        topics = {r["kv_events"]["topic"] for r in ranks}
        assert topics == {info["kv_events"]["topic"]}  # one topic for every rank, as vLLM's
        metrics = httpx.get(f"{w.url}/metrics").text
        engines = re.findall(r'vllm:num_requests_running\{[^}]*engine="(\d)"', metrics)
        assert sorted(engines) == ["0", "1"]
        # Straight to the worker: rank 1 caches a long prompt; rank 0 does not.
        long = "the quick brown fox jumps over the lazy dog " * 6
        r = httpx.post(f"{w.url}/v1/chat/completions", json=chat(long),
                       headers={"X-data-parallel-rank": "1"})  # fmt: skip
        assert r.status_code == 200
        blocks = [len(httpx.get(f"{w.url}/kv/snapshot?rank={k}").json()["blocks"]) for k in (0, 1)]
        assert blocks[0] == 0 and blocks[1] > 0
        bad = httpx.post(f"{w.url}/v1/chat/completions", json=chat("x"),
                         headers={"X-data-parallel-rank": "2"})  # fmt: skip
        assert bad.status_code == 400 and "out of range [0, 2)" in bad.json()["error"]["message"]

        port = free_port()
        args = ["-m", "gateway", "--workers", w.url, "--port", str(port), "--poll-interval", "0.2"]
        gw = Proc("gateway", args, port, tmp_path / "gw.log")
        gw.start()
        try:
            gw.wait_healthy(60)
            rank1 = f"{w.url}#dp1"
            deadline = time.monotonic() + 20
            while True:
                reps = httpx.get(f"{gw.url}/kvgate/index").json()["replicas"]
                if all(reps.get(r, {}).get("synced") for r in (w.url, rank1)):
                    break
                assert time.monotonic() < deadline, gw.log_tail()
                time.sleep(0.1)
            wait_index_converged(gw.url, [w.url, rank1])  # rank 1's blocks from its snapshot
            resp = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(long), timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-replica"] == rank1
            predicted = int(resp.headers["x-kvgate-predicted-cached-tokens"])
            assert predicted > 0
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
            for i in range(4):  # new prefixes spread over both ranks; each index follows its own
                httpx.post(f"{gw.url}/v1/chat/completions", json=chat(f"{i} " * 40), timeout=30)
            wait_index_converged(gw.url, [w.url, rank1])
        finally:
            gw.kill()
