"""Parity: a worker whose key fingerprint differs from its model's majority is load-only."""

from __future__ import annotations

import time

import httpx

from gateway.names import replica_name
from harness.cluster import Cluster, ClusterSpec
from harness.ports import free_port
from harness.proc import Proc
from harness.waits import wait_index_converged


def test_mismatching_worker_is_flagged_and_routed_by_load_only(tmp_path):
    good = ClusterSpec(workers=2, engine="sim", gateways=0, log_dir=tmp_path / "a")
    odd = ClusterSpec(
        workers=1,
        engine="sim",
        gateways=0,
        worker_args=("--hash-seed", "another-seed"),
        log_dir=tmp_path / "b",
    )
    with Cluster(good) as a, Cluster(odd) as b:
        urls = [*a.worker_urls, *b.worker_urls]
        port = free_port()
        args = ["-m", "gateway", "--workers", ",".join(urls), "--port", str(port)]
        gw = Proc("gateway", [*args, "--poll-interval", "0.2"], port, tmp_path / "gw.log")
        gw.start()
        try:
            gw.wait_healthy(60)
            deadline = time.monotonic() + 15
            while True:
                reps = httpx.get(f"{gw.url}/kvgate/index").json()["replicas"]
                if len(reps) == 3 and all(r["healthy"] for r in reps.values()):
                    break
                assert time.monotonic() < deadline, reps
                time.sleep(0.1)
            assert [reps[u]["parity_ok"] for u in urls] == [True, True, False]
            metrics = httpx.get(f"{gw.url}/metrics").text
            odd, even = b.replica_name(b.worker_urls[0]), a.replica_name(a.worker_urls[0])
            assert f'kvgate_parity_mismatch{{replica="{odd}"}} 1.0' in metrics
            assert f'kvgate_parity_mismatch{{replica="{even}"}} 0.0' in metrics
            # The odd worker still serves traffic (by load), and never gets a prediction.
            body = {"model": "demo", "prompt": "hello " * 40, "max_tokens": 2}
            hdr = {"x-kvgate-routing-policy": "round_robin"}
            seen = {}
            for _ in range(6):
                r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=hdr, timeout=30)
                assert r.status_code == 200, r.text
                seen[r.headers["x-kvgate-replica"]] = r.headers["x-kvgate-predicted-cached-tokens"]
                time.sleep(0.1)
            assert seen[replica_name(b.worker_urls[0], None)] == "0"
        finally:
            gw.kill()


def test_local_model_dir_assets_match_the_workers(tmp_path):
    from worker.demo.model import ensure_demo_model

    spec = ClusterSpec(
        workers=1,
        engine="sim",
        gateway_args=("--poll-interval", "0.2", "--model-dir", str(ensure_demo_model())),
        log_dir=tmp_path,
    )
    with Cluster(spec) as c:
        body = {"model": "demo", "prompt": "a local tokenizer " * 30, "max_tokens": 2}
        first = httpx.post(f"{c.gateway_url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        wait_index_converged(c.gateway_url, c.worker_urls)
        second = httpx.post(f"{c.gateway_url}/v1/completions", json=body, timeout=30)
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        assert int(second.headers["x-kvgate-predicted-cached-tokens"]) == cached
        metrics = httpx.get(f"{c.gateway_url}/metrics").text
        assert 'kvgate_parity_mismatch{replica="gateway"} 0.0' in metrics
