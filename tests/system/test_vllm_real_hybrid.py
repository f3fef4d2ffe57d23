"""kvgate in front of a real vLLM serving a hybrid model (sliding-window + full attention, the
shape of Gemma 3 and GPT-OSS; worker/demo/hybrid.py), its events in connect mode: `make
test-vllm`. vLLM's sliding-window group keeps only the blocks a later hit can end on, so a prompt
that shares only the early part of a cached one hits nothing; the gateway must predict exactly
that, request by request, and reject none of vLLM's events.
"""

from __future__ import annotations

import pytest

from harness.prom import metric_total
from tests.support.vllm_fleet import assert_exact, reset_caches, settled_ask, start_gateway
from worker.demo.tokenizer import build_tokenizer

# The first test also waits for the servers to start (minutes on 2 busy cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def session_tokens() -> list[int]:
    text = " ".join(f"token {i} of the hybrid session, block by block." for i in range(200))
    return build_tokenizer().encode(text).ids


def completion(prompt: list[int]) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": 1}


def test_hybrid_model_predicted_exactly_whole_most_or_early_prefix(vllm_fleet):
    fleet = vllm_fleet
    servers = [fleet.hybrid]
    t = session_tokens()
    a = t[:623]
    session = [
        ("cold", a, 0),
        ("the whole 608-token prefix, another ending", [*a[:608], *t[700:715]], 608),
        ("diverges after 450 tokens", [*a[:450], 7], 0),
        ("the same again: its window's blocks are kept now", [*a[:450], 7], 448),
        ("diverges after 240 tokens", [*a[:240], 9, 9], 0),
        ("a again", a, 608),
    ]
    gw = start_gateway(
        fleet, servers, fleet.hybrid_dir, "gw-hybrid", "--kv-events-bind", fleet.hybrid_bind
    )
    try:
        reset_caches(gw, servers)
        answers = [
            settled_ask(gw, servers, completion(p), path="completions") for _, p, _ in session
        ]
        errors = metric_total(gw.url, "kvgate_event_errors_total")
        skipped = metric_total(gw.url, "kvgate_events_skipped_unknown_parent_total")
    finally:
        gw.kill()
    assert_exact(answers)
    assert [a.reported for a in answers] == [want for _, _, want in session], [
        (note, a.reported) for (note, _, _), a in zip(session, answers, strict=True)
    ]
    assert errors == 0 and skipped == 0  # no event rejected, none left unkeyed


def test_events_only_through_replay_are_named_in_the_log(vllm_fleet):
    """The hybrid server's publisher connects (connect mode); a gateway configured as if it bound
    `kv-events=PORT` gets nothing live. Its predictions still come right by replay, late, and it
    says in its log which worker and why."""
    fleet = vllm_fleet
    h = fleet.hybrid
    servers = [h]
    entry = f"{h.url};kv-events={h.events_port};kv-replay={h.replay_port};kv-topic={h.topic}"
    name = "gw-hybrid-misconfigured"
    # Its log is appended to across runs of the suite in one checkout: read only this run's.
    earlier = fleet.log_dir / f"{name}.log"
    start = earlier.stat().st_size if earlier.exists() else 0
    gw = start_gateway(fleet, servers, fleet.hybrid_dir, name, workers=entry)
    try:
        reset_caches(gw, servers)  # its batch comes by a tail check
        t = session_tokens()
        answers = [  # each prompt a block longer: each stores blocks, in a batch of its own
            settled_ask(gw, servers, completion(t[:n]), path="completions") for n in (300, 340, 380)
        ]
        with gw.log_path.open("rb") as f:
            f.seek(start)
            log = f.read().decode(errors="replace")
    finally:
        gw.kill()
    assert_exact(answers)
    assert all(a.reported > 0 for a in answers[1:])
    (line,) = [ln for ln in log.splitlines() if "only through replay" in ln]
    assert h.url in line and f":{h.events_port}" in line
