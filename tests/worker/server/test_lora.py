"""LoRA through a live worker's HTTP API: adapters named by `model`, vLLM's load/unload API and
its errors, the model list, /kvgate/info and vllm:lora_requests_info."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekey.documents import WorkerInfo, decode_document
from tests.support.lora_fixtures import write_peft_adapter, write_tiny_llama
from tests.support.worker_harness import REPO, WorkerProcess
from worker.demo.lora import DEMO_ADAPTERS, lora_modules_arg, write_demo_adapter

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. " * 4  # > 3 blocks
BLOCK = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-lora")
    return {name: write_demo_adapter(root / name, name) for name in DEMO_ADAPTERS}


@pytest.fixture(scope="module")
def worker(demo_model_dir, adapters):
    args = ["--device", "cpu", "--max-loras", "2", "--allow-runtime-lora-updating"]
    args += ["--lora-modules", lora_modules_arg(adapters)]
    with WorkerProcess(demo_model_dir, *args, engine="torch") as w:
        yield w


def complete(url: str, model: str, prompt: str = PROMPT, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def error(resp: httpx.Response) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["message"]


def test_models_lists_adapters_with_their_parent(worker, adapters):
    data = httpx.get(f"{worker.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [
        ("demo", None),
        ("alpha", "demo"),
        ("beta", "demo"),
    ]
    assert {m["id"]: m["root"] for m in data[1:]} == {n: str(p) for n, p in adapters.items()}


def test_model_names_the_adapter_and_adapters_never_share_blocks(worker):
    texts, cached = {}, {}
    for model in ("demo", "alpha", "beta"):
        resp = complete(worker.url, model, f"{model}: {PROMPT}")
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == model
        texts[model] = resp.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # the adapters change what the model says
    for model in ("alpha", "beta", "alpha", "demo"):  # one prompt: cold, then per adapter
        usage = complete(worker.url, model, f"Same for all: {PROMPT}").json()["usage"]
        cached.setdefault(model, []).append(usage["prompt_tokens_details"]["cached_tokens"])
    p = usage["prompt_tokens"]
    assert cached["alpha"] == [0, ((p - 1) // BLOCK) * BLOCK]  # its own blocks only
    assert cached["beta"] == [0] and cached["demo"] == [0]
    chunks = httpx.post(
        f"{worker.url}/v1/chat/completions",
        json={"model": "beta", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=60,
    ).text.splitlines()
    first = json.loads(chunks[0].removeprefix("data: "))
    assert first["model"] == "beta"


def test_unknown_model_is_404(worker):
    status, message = error(complete(worker.url, "gamma"))
    assert status == 404
    assert (
        message == "The model `gamma` does not exist; this worker serves `demo`, `alpha`, `beta`."
    )


def test_load_and_unload_at_runtime(worker, adapters):
    load = f"{worker.url}/v1/load_lora_adapter"
    unload = f"{worker.url}/v1/unload_lora_adapter"
    resp = httpx.post(load, json={"lora_name": "gamma", "lora_path": str(adapters["beta"])})
    assert (resp.status_code, resp.text) == (
        200,
        "Success: LoRA adapter 'gamma' added successfully.",
    )
    ids = [m["id"] for m in httpx.get(f"{worker.url}/v1/models").json()["data"]]
    assert ids == ["demo", "alpha", "beta", "gamma"]
    prompt = f"gamma: {PROMPT}"
    beta, gamma = complete(worker.url, "beta", prompt).json(), complete(worker.url, "gamma", prompt)
    assert gamma.json()["choices"][0]["text"] == beta["choices"][0]["text"]  # the same weights
    assert gamma.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another name
    body = {"lora_name": "gamma", "lora_path": str(adapters["alpha"]), "load_inplace": True}
    assert httpx.post(load, json=body).status_code == 200  # gamma now has alpha's weights
    answers = {
        model: complete(worker.url, model, "in place: " + prompt).json()["choices"][0]["text"]
        for model in ("alpha", "beta", "gamma")
    }
    assert answers["gamma"] == answers["alpha"] != answers["beta"]
    resp = httpx.post(unload, json={"lora_name": "gamma"})
    assert (resp.status_code, resp.text) == (
        200,
        "Success: LoRA adapter 'gamma' removed successfully.",
    )
    assert error(complete(worker.url, "gamma"))[0] == 404
    assert error(httpx.post(unload, json={"lora_name": "gamma"})) == (
        404,
        "The lora adapter 'gamma' cannot be found.",
    )


def test_load_errors(worker, adapters, demo_model_dir, tmp_path):
    load = f"{worker.url}/v1/load_lora_adapter"
    wide = tmp_path / "wide"
    shutil.copytree(adapters["alpha"], wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    llama = write_tiny_llama(tmp_path / "llama", demo_model_dir)
    foreign = write_peft_adapter(llama, tmp_path / "foreign", 1, r=4, target_modules=["q_proj"])
    cases = [
        ({"lora_name": "alpha", "lora_path": str(adapters["alpha"])}, 400, "has already been"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 404, "No adapter found for"),
        ({"lora_name": "x", "lora_path": str(wide)}, 400, "LoRA rank 32 is greater than max_lora"),
        ({"lora_name": "x", "lora_path": str(foreign)}, 400, "incompatible with the base model"),
        ({"lora_path": str(adapters["alpha"])}, 400, "Both 'lora_name' and 'lora_path' must be"),
        ({"lora_name": "demo", "lora_path": str(adapters["alpha"])}, 400, "the base model's"),
    ]
    for body, status, message in cases:
        resp = httpx.post(load, json=body)
        assert resp.status_code == status, (body, resp.text)
        body_error = resp.json()["error"]
        assert message in body_error["message"]
        assert body_error["type"] == "invalid_request_error"
    ids = [m["id"] for m in httpx.get(f"{worker.url}/v1/models").json()["data"]]
    assert "x" not in ids
    nameless = httpx.post(f"{worker.url}/v1/unload_lora_adapter", json={})
    assert nameless.status_code == 400
    assert nameless.json()["error"]["code"] == "missing_required_parameter"


def test_info_and_metrics_name_the_adapters(worker):
    complete(worker.url, "alpha")
    info = decode_document(httpx.get(f"{worker.url}/kvgate/info").content, WorkerInfo)
    assert info.lora is not None
    assert info.lora.max_loras == 2 and info.lora.max_lora_rank == 16
    assert info.lora.adapters[:2] == ["alpha", "beta"]
    assert "alpha" in info.lora.resident
    metrics = httpx.get(f"{worker.url}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info")]
    assert len(lines) == 1
    assert lines[0].startswith(
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    )
    loads = [line for line in metrics.splitlines() if line.startswith("kvgate_worker_lora_loads")]
    assert float(loads[0].rsplit(" ", 1)[1]) >= 2


def test_sim_worker_serves_adapters_without_the_runtime_api(demo_model_dir, adapters):
    args = ["--lora-modules", lora_modules_arg(adapters)]
    with WorkerProcess(demo_model_dir, *args, engine="sim") as w:
        assert complete(w.url, "alpha").status_code == 200
        info = decode_document(httpx.get(f"{w.url}/kvgate/info").content, WorkerInfo)
        assert info.lora is not None and info.lora.resident == ["alpha"]
        resp = httpx.post(f"{w.url}/v1/load_lora_adapter", json={"lora_name": "x"})
        assert resp.status_code == 404  # not mounted without --allow-runtime-lora-updating
    plain_info = None
    with WorkerProcess(demo_model_dir, engine="sim") as w:
        plain_info = decode_document(httpx.get(f"{w.url}/kvgate/info").content, WorkerInfo)
        assert "vllm:lora_requests_info" not in httpx.get(f"{w.url}/metrics").text
        assert error(complete(w.url, "alpha"))[0] == 404
    assert plain_info.lora is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lora-modules", "alpha"], "--lora-modules takes name=path or"),
        (["--lora-modules", "alpha=/nonexistent"], "No adapter found for /nonexistent"),
        (["--lora-modules", '{"name": "alpha"}'], "JSON needs string `name` and `path`"),
        (["--lora-modules", '{"name": "a", "path": "/p", "rank": 8}'], "unknown fields ['rank']"),
        (["--lora-modules", '{"name": "a",'], "--lora-modules: not a JSON object"),
    ],
)
def test_bad_lora_modules_stop_the_worker_with_a_message(demo_model_dir, args, message):
    cmd = [sys.executable, "-m", "worker", "--model", str(demo_model_dir), "--engine", "sim"]
    done = subprocess.run(cmd + args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
