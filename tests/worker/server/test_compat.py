"""/kvgate/info, /kvgate/assets, /metrics names, and the peer-router endpoints."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from cachekey.assets import ModelAssets
from cachekey.documents import AssetFiles, Snapshot, WorkerInfo, decode_document
from cachekey.render import Renderer
from tests.support.worker_harness import WorkerProcess

METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:cache_config_info",
    "kvgate_worker_encoder_cache_hits_total",
    "kvgate_worker_images_processed_total",
    "kvgate_worker_vision_tower_runs_total",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    with WorkerProcess(demo_model_dir, "--num-blocks", "64", engine="sim") as w:
        yield w


def _get(w: WorkerProcess, path: str):
    r = httpx.get(w.url + path, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_info_describes_keys_events_and_instance(worker, demo_model_dir):
    info = _get(worker, "/kvgate/info")
    assert info["model"] == "demo" and info["engine"] == "sim"
    assert info["block_size"] == 16 and info["hash_seed"] == "kvgate-v1"
    assert info["mm_match_rule"] == "partial"  # the engine reuses blocks that end in an image
    assert len(info["instance_id"]) == 32
    assert info["kv_events"] == {
        "enabled": True,
        "port": worker.events_port,
        "replay_port": worker.replay_port,
        "topic": f"kv@{info['instance_id']}@demo",
        "curve": False,  # no worker token: plain sockets
    }
    local = ModelAssets.from_dir(demo_model_dir)
    assert info["fingerprint_parts"]["assets"] == local.fingerprint()
    assert info["fingerprint_parts"]["block_size"] == 16


def test_documents_decode_into_the_shared_structs(worker):
    """What the worker writes is exactly what the gateway's decoders accept."""
    info = decode_document(httpx.get(worker.url + "/kvgate/info").content, WorkerInfo)
    assert info.fingerprint_parts is not None and info.has_snapshot
    assert info.fingerprint == info.fingerprint_parts.digest()
    assert info.namespace().block_size == 16 and info.max_model_len and info.num_blocks == 64
    assert info.host_num_blocks is None  # no host tier (--kv-offload-blocks)
    body = {"model": "demo", "prompt": "documents " * 20, "max_tokens": 1}
    assert httpx.post(worker.url + "/v1/completions", json=body, timeout=30).status_code == 200
    snap = decode_document(httpx.get(worker.url + "/kv/snapshot").content, Snapshot)
    assert snap.instance_id == info.instance_id and snap.block_size == 16 and snap.blocks
    assert snap.blocks[0].parent is None
    files = decode_document(httpx.get(worker.url + "/kvgate/assets").content, AssetFiles).files
    assert ModelAssets.from_files(files).fingerprint() == info.fingerprint_parts.assets


def test_assets_rebuild_the_same_renderer(worker, demo_model_dir):
    files = {k: base64.b64decode(v) for k, v in _get(worker, "/kvgate/assets")["files"].items()}
    remote = ModelAssets.from_files(files)
    assert remote.fingerprint() == _get(worker, "/kvgate/info")["fingerprint_parts"]["assets"]
    rendered = _get_render(worker, "/v1/chat/completions/render", {"messages": MESSAGES})
    assert list(Renderer(remote).render_chat(MESSAGES).token_ids) == rendered


def _get_render(w: WorkerProcess, path: str, body: dict) -> list[int]:
    r = httpx.post(w.url + path, json={"model": "demo", **body})
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_render_and_tokenize_agree_with_usage(worker):
    chat_ids = _get_render(worker, "/v1/chat/completions/render", {"messages": MESSAGES})
    used = httpx.post(
        worker.url + "/v1/chat/completions",
        json={"model": "demo", "messages": MESSAGES, "max_tokens": 1},
    ).json()
    assert used["usage"]["prompt_tokens"] == len(chat_ids)
    tok = httpx.post(worker.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert tok["tokens"] == chat_ids and tok["count"] == len(chat_ids)
    text_ids = _get_render(worker, "/v1/completions/render", {"prompt": "plain text prompt"})
    tok = httpx.post(worker.url + "/tokenize", json={"prompt": "plain text prompt"}).json()
    assert tok["tokens"] == text_ids and tok["max_model_len"] == 4096
    assert httpx.post(worker.url + "/tokenize", json={}).status_code == 400


def test_sglang_router_endpoints(worker, demo_model_dir):
    for path in ("/get_model_info", "/model_info"):
        info = _get(worker, path)
        assert info["is_generation"] is True
        assert Path(info["model_path"]) == Path(demo_model_dir)
        assert (Path(info["tokenizer_path"]) / "tokenizer.json").is_file()
    for path in ("/get_server_info", "/server_info"):
        s = _get(worker, path)
        assert s["page_size"] == 16 and s["max_total_num_tokens"] == 64 * 16
        assert s["served_model_name"] == "demo"
    (load,) = _get(worker, "/get_load")
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_metrics_use_vllm_names_and_count_prefix_hits(worker):
    prompt = list(range(100, 180))  # 5 full blocks
    for _ in range(2):
        r = httpx.post(
            worker.url + "/v1/completions",
            json={"model": "demo", "prompt": prompt, "max_tokens": 2},
        )
        assert r.status_code == 200
    text = httpx.get(worker.url + "/metrics").text
    for name in METRICS:
        assert f"\n{name}{{" in text, name
    assert 'block_size="16"' in text and 'num_gpu_blocks="64"' in text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["vllm:prefix_cache_hits_total"] >= 64  # the second request hit 4 blocks
    assert values["vllm:prefix_cache_queries_total"] >= 160
    assert values["vllm:generation_tokens_total"] >= 4


def test_models_and_health(worker):
    models = _get(worker, "/v1/models")
    assert models["data"][0]["id"] == "demo"
    assert models["data"][0]["max_model_len"] == 4096
    assert httpx.get(worker.url + "/health").status_code == 200
    assert "kvgate worker ready: http://127.0.0.1:" in worker.log()


def test_model_demo_generates_the_model_into_the_cache_dir(tmp_path):
    with WorkerProcess("demo", events=False, env={"KVGATE_CACHE_DIR": str(tmp_path)}) as w:
        info = _get(w, "/get_model_info")
        assert Path(info["model_path"]).parent == tmp_path
        assert (Path(info["model_path"]) / "config.json").is_file()
        assert _get(w, "/kvgate/info")["kv_events"]["enabled"] is False
