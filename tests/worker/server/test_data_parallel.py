"""A kvgate worker serving two data-parallel ranks behind one URL (`--data-parallel-size 2`)
looks to the gateway as a vLLM server with two engines does: two replicas, each indexed from its
own events on its own ports, loaded from its own `engine` label, and named by
`X-data-parallel-rank`. Real worker and gateway processes, real HTTP and ZMQ."""

from __future__ import annotations

import json
import re

import httpx

from cachekey.documents import Snapshot, WorkerInfo, decode_document
from gateway.names import replica_name
from harness.extproc_client import ExtProcClient, forward
from harness.ports import free_port, free_port_run
from harness.proc import Proc
from harness.waits import index_mismatches, wait_index_converged, wait_until
from tests.support.chat import bearer, chat, chat_body, user
from tests.support.waits import wait_synced
from tests.support.worker_harness import WorkerProcess
from worker.demo.lora import DEMO_ADAPTERS, write_demo_adapter


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
        r = chat(w.url, user(long), {"X-data-parallel-rank": "1"})
        assert r.status_code == 200
        blocks = [len(httpx.get(f"{w.url}/kv/snapshot?rank={k}").json()["blocks"]) for k in (0, 1)]
        assert blocks[0] == 0 and blocks[1] > 0
        none = httpx.get(f"{w.url}/kv/snapshot?rank=2")
        assert none.status_code == 404 and none.json()["error"]["code"] == "invalid_value"
        bad = chat(w.url, user("x"), {"X-data-parallel-rank": "2"})
        assert bad.status_code == 400 and "out of range [0, 2)" in bad.json()["error"]["message"]

        port = free_port()
        args = ["-m", "gateway", "--workers", w.url, "--port", str(port), "--poll-interval", "0.2"]
        gw = Proc("gateway", args, port, tmp_path / "gw.log")
        gw.start()
        try:
            gw.wait_healthy(60)
            rank1 = f"{w.url}#dp1"
            wait_synced(gw.url, 2)  # the worker's URL and rank 1's
            wait_index_converged(gw.url, [w.url, rank1])  # rank 1's blocks from its snapshot
            resp = chat(gw.url, user(long))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-replica"] == replica_name(rank1, None)
            predicted = int(resp.headers["x-kvgate-predicted-cached-tokens"])
            assert predicted > 0
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
            for i in range(4):  # new prefixes spread over both ranks; each index follows its own
                chat(gw.url, user(f"{i} " * 40))
            wait_index_converged(gw.url, [w.url, rank1])
        finally:
            gw.kill()


TOKEN = "wt-" + "7c1e9a3b5d2f4e6a8c0b1d2e3f4a5b6c"
AS_GATEWAY = bearer(TOKEN)


def test_two_ranks_with_a_worker_token_lora_and_embeddings(tmp_path, demo_model_dir):
    """Every feature per rank: each rank's events are CURVE-keyed by the token and its snapshot
    needs it; an adapter loaded at runtime is on both ranks and resident only where it ran; an
    embedding hits the cache of the rank its header names; the gateway (holding the token)
    indexes both ranks and names each replica with its own keyed name."""
    adapters = {n: write_demo_adapter(tmp_path / n, n) for n in DEMO_ADAPTERS}
    first, *rest = adapters
    ev, rp = free_port_run(2), free_port_run(2)
    args = ["--data-parallel-size", "2", "--kv-events-port", str(ev)]
    args += ["--kv-events-replay-port", str(rp), "--max-loras", "1"]
    args += ["--allow-runtime-lora-updating", "--lora-modules", f"{first}={adapters[first]}"]
    env = {"KVGATE_WORKER_TOKEN": TOKEN}
    with WorkerProcess(demo_model_dir, *args, engine="torch", env=env) as w:
        assert httpx.get(f"{w.url}/kv/snapshot?rank=1").status_code == 401

        def info() -> WorkerInfo:
            r = httpx.get(f"{w.url}/kvgate/info", headers=AS_GATEWAY)
            return decode_document(r.content, WorkerInfo)

        assert [r.kv_events.curve for r in info().data_parallel_ranks] == [True, True]
        name = rest[0]
        body = {"lora_name": name, "lora_path": str(adapters[name])}
        r = httpx.post(f"{w.url}/v1/load_lora_adapter", json=body, headers=AS_GATEWAY)
        assert r.status_code == 200, r.text
        assert all(name in r.lora.adapters for r in info().data_parallel_ranks)
        prompt = {"model": name, "prompt": "adapter on rank one " * 8, "max_tokens": 2}
        r = httpx.post(f"{w.url}/v1/completions", json=prompt, timeout=60,
                       headers={**AS_GATEWAY, "X-data-parallel-rank": "1"})  # fmt: skip
        assert r.status_code == 200, r.text
        wait_until(lambda: name in info().data_parallel_ranks[1].lora.resident, 10, "resident")
        assert name not in info().data_parallel_ranks[0].lora.resident

        def embed(rank: int) -> int:
            body = {"model": "demo", "input": "embed me on one rank " * 8}
            r = httpx.post(f"{w.url}/v1/embeddings", json=body, timeout=60,
                           headers={**AS_GATEWAY, "X-data-parallel-rank": str(rank)})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert embed(1) == 0 and embed(1) > 0 and embed(0) == 0  # each rank its own cache

        port = free_port()
        gw_args = ["-m", "gateway", "--workers", w.url, "--port", str(port)]
        gw = Proc("gateway", [*gw_args, "--poll-interval", "0.2"], port, tmp_path / "gw.log")
        gw.env = env
        gw.start()
        try:
            gw.wait_healthy(60)
            rank1 = f"{w.url}#dp1"

            def converged() -> bool:
                reps = httpx.get(f"{gw.url}/kvgate/index").json()["replicas"]
                for rid, rank in ((w.url, 0), (rank1, 1)):
                    snap = httpx.get(f"{w.url}/kv/snapshot?rank={rank}", headers=AS_GATEWAY)
                    blocks = len({b.key for b in decode_document(snap.content, Snapshot).blocks})
                    entry = reps.get(rid, {})
                    if not entry.get("synced") or entry.get("blocks") != blocks:
                        return False
                return True

            wait_until(converged, 30, "the gateway's index of both ranks")
            names = {
                e["name"] for e in httpx.get(f"{gw.url}/kvgate/index").json()["replicas"].values()
            }
            assert names == {replica_name(w.url, TOKEN), replica_name(rank1, TOKEN)}
            again = {**prompt, "max_tokens": 1}
            r = httpx.post(f"{gw.url}/v1/completions", json=again, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-replica"] == replica_name(rank1, TOKEN)
            assert int(r.headers["x-kvgate-predicted-cached-tokens"]) > 0
        finally:
            gw.kill()
        assert TOKEN not in (tmp_path / "gw.log").read_text(errors="replace")


def test_the_endpoint_picker_names_the_rank(tmp_path, demo_model_dir):
    """As the EPP of an InferencePool: the pick of a data-parallel rank carries that rank's
    X-data-parallel-rank index, and the fallbacks are only endpoints that take the same header
    (a one-engine worker takes none), so the proxy never sends the header to the wrong engine."""
    ev, rp = free_port_run(2), free_port_run(2)
    dp = ("--data-parallel-size", "2", "--kv-events-port", str(ev), "--kv-events-replay-port")
    with WorkerProcess(demo_model_dir, *dp, str(rp)) as w, WorkerProcess(demo_model_dir) as single:
        long = "the endpoint picker names the rank " * 6
        r = chat(w.url, user(long), {"X-data-parallel-rank": "1"})
        assert r.status_code == 200
        http, grpc_port = free_port(), free_port()
        args = ["-m", "gateway", "--workers", f"{w.url},{single.url}", "--port", str(http)]
        args += ["--epp", "--epp-port", str(grpc_port), "--poll-interval", "0.2", "--retries", "2"]
        epp = Proc("epp", args, http, tmp_path / "epp.log")
        epp.start()
        try:
            epp.wait_healthy(60)
            rank1 = f"{w.url}#dp1"
            wait_until(
                lambda: not index_mismatches(epp.url, [w.url, rank1, single.url]), 20, "sync"
            )
            with ExtProcClient(f"127.0.0.1:{grpc_port}") as client:
                call = client.call()
                body = json.dumps(chat_body(user(long), max_tokens=2)).encode()
                ans = call.request("/v1/chat/completions", body)
                assert ans.set_headers["x-data-parallel-rank"] == "1"
                assert ans.endpoints == [w.url.removeprefix("http://")]
                status, _, relayed = forward(call, ans, "/v1/chat/completions")
            assert status == 200
            assert relayed.set_headers["x-kvgate-replica"] == replica_name(rank1, None)
            assert int(relayed.set_headers["x-kvgate-predicted-cached-tokens"]) > 0
        finally:
            epp.kill()
