"""Drive a `Workload` through an OpenAI-compatible endpoint with the official `openai` client.

Turns of one conversation are sent in order (each carries the replies so far); conversations run
concurrently up to a limit. Every result keeps what the gateway and the worker said about caching.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from openai import AsyncOpenAI

from harness.workload import Turn, Workload


@dataclass(slots=True)
class Result:
    conversation: str
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    predicted_cached_tokens: int | None
    latency_s: float
    ttft_s: float | None
    ok: bool
    error: str | None = None
    sent_at: float = 0.0  # perf_counter() when it was sent (orders a run's requests in time)
    # Of `predicted_cached_tokens`, those the gateway expected the host KV tier to serve.
    predicted_cpu_tokens: int | None = None
    # Of `cached_tokens`, those the worker copied back from its host KV tier (kvgate's
    # `usage.prompt_tokens_details.cpu_cached_tokens`); None: a worker without the tier.
    cpu_cached_tokens: int | None = None


def _cached(usage: object) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0


def _cpu_cached(usage: object) -> int | None:
    """kvgate's host-tier part of the cached tokens (an extra field to the OpenAI client)."""
    value = getattr(getattr(usage, "prompt_tokens_details", None), "cpu_cached_tokens", None)
    return int(value) if value is not None else None


async def _send(
    client: AsyncOpenAI,
    model: str,
    messages: list[dict],
    max_tokens: int,
    headers: dict[str, str],
    stream: bool = False,
) -> tuple[str, str, int, int, int | None, float, float | None, tuple[int | None, int | None]]:
    t0 = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_headers=headers,
        **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
    )
    predicted = raw.headers.get("x-kvgate-predicted-cached-tokens")
    cpu = raw.headers.get("x-kvgate-predicted-cpu-cached-tokens")
    replica = raw.headers.get("x-kvgate-replica", "direct")
    ttft = None
    if stream:
        # TTFT is the time to the first chunk that carries content, as a user would see it.
        parts: list[str] = []
        usage = None
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        text = "".join(parts)
    else:
        resp = raw.parse()
        text, usage = resp.choices[0].message.content or "", resp.usage
    latency = time.perf_counter() - t0
    return (
        text,
        replica,
        usage.prompt_tokens if usage else 0,
        _cached(usage),
        int(predicted) if predicted is not None else None,
        latency,
        ttft,
        (int(cpu) if cpu is not None else None, _cpu_cached(usage)),
    )


async def send_turn(
    client: AsyncOpenAI,
    model: str,
    messages: list[dict],
    turn: Turn,
    max_tokens: int,
    headers: dict[str, str],
    stream: bool,
) -> tuple[Result, str]:
    """One turn's request: its Result and the reply's text ("" when it failed)."""
    sent_at = time.perf_counter()
    try:
        text, replica, pt, ct, pred, lat, ttft, cpu = await _send(
            client, model, messages, max_tokens, headers, stream
        )
    except Exception as e:  # a failed request is a result too: it is counted, not hidden
        error = f"{type(e).__name__}: {e}"
        return Result(turn.conversation, turn.turn, "-", 0, 0, None, 0.0, None, False, error), ""
    res = Result(turn.conversation, turn.turn, replica, pt, ct, pred, lat, ttft, True)
    res.sent_at, (res.predicted_cpu_tokens, res.cpu_cached_tokens) = sent_at, cpu
    return res, text


async def run_side_by_side(
    base_urls: list[str],
    workload: Workload,
    *,
    model: str = "demo",
    timeout: float = 120.0,
    stream: bool = False,
) -> dict[str, list[Result]]:
    """Send each turn to every endpoint at once and the next turn when all have answered: the
    endpoints serve the same trace under the same load, step by step (benchmarks that compare
    two engine settings). Each endpoint's conversations carry its own replies."""
    clients = {
        url: AsyncOpenAI(
            base_url=f"{url}/v1", api_key="kvgate-demo", timeout=timeout, max_retries=0
        )
        for url in base_urls
    }
    histories: dict[str, dict[str, list[dict]]] = {url: {} for url in base_urls}
    results: dict[str, list[Result]] = {url: [] for url in base_urls}

    async def one(url: str, turn: Turn) -> None:
        convs = histories[url]
        msgs = convs.setdefault(turn.conversation, workload.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        res, text = await send_turn(
            clients[url], model, msgs, turn, workload.spec.max_tokens, {}, stream
        )
        msgs.append({"role": "assistant", "content": text})
        results[url].append(res)

    for turn in workload:
        await asyncio.gather(*(one(url, turn) for url in base_urls))
    for client in clients.values():
        await client.close()
    return results


async def run_workload(
    base_url: str,
    workload: Workload,
    *,
    model: str = "demo",
    concurrency: int = 4,
    headers: dict[str, str] | None = None,
    on_result: Callable[[Result], None] | None = None,
    timeout: float = 120.0,
    headers_for: Callable[[Turn], dict[str, str]] | None = None,
    stream: bool = False,
    model_for: Callable[[Turn], str] | None = None,
) -> list[Result]:
    """`headers_for` adds per-turn headers (e.g. a session id); `stream` measures TTFT;
    `model_for` names each turn's model (e.g. its tenant's LoRA adapter)."""
    client = AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="kvgate-demo", timeout=timeout, max_retries=0
    )
    sem = asyncio.Semaphore(concurrency)
    histories: dict[str, list[dict]] = {}
    previous: dict[str, asyncio.Future[None]] = {}
    results: list[Result] = []
    loop = asyncio.get_running_loop()

    async def one(turn: Turn, before: asyncio.Future[None] | None, done: asyncio.Future[None]):
        if before is not None:
            await before
        msgs = histories.setdefault(turn.conversation, workload.initial_messages(turn.tenant))
        msgs.append({"role": "user", "content": turn.content})
        async with sem:
            hdrs = {**(headers or {}), **(headers_for(turn) if headers_for else {})}
            turn_model = model_for(turn) if model_for else model
            res, text = await send_turn(
                client, turn_model, msgs, turn, workload.spec.max_tokens, hdrs, stream
            )
        msgs.append({"role": "assistant", "content": text})
        results.append(res)
        if on_result is not None:
            on_result(res)
        done.set_result(None)

    tasks = []
    for turn in workload:
        done: asyncio.Future[None] = loop.create_future()
        tasks.append(asyncio.create_task(one(turn, previous.get(turn.conversation), done)))
        previous[turn.conversation] = done
    await asyncio.gather(*tasks)
    await client.close()
    return results


@dataclass(slots=True)
class ReplicaSummary:
    replica: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    exact_predictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summarize(results: list[Result]) -> dict[str, ReplicaSummary]:
    by: dict[str, ReplicaSummary] = defaultdict(lambda: ReplicaSummary(""))
    for r in results:
        if not r.ok:
            continue
        s = by[r.replica]
        s.replica = r.replica
        s.requests += 1
        s.prompt_tokens += r.prompt_tokens
        s.cached_tokens += r.cached_tokens
        s.predicted_tokens += r.predicted_cached_tokens or 0
        s.exact_predictions += int(r.predicted_cached_tokens == r.cached_tokens)
    return dict(sorted(by.items()))


def hit_rate(results: list[Result]) -> float:
    prompt = sum(r.prompt_tokens for r in results if r.ok)
    return sum(r.cached_tokens for r in results if r.ok) / prompt if prompt else 0.0


def warm_results(results: Sequence[Result], concurrency: int) -> list[Result]:
    """The requests sent after every one of the first `concurrency` had finished.

    A run opens with `concurrency` requests sent at once on empty caches: every one is a full
    prefill, queued behind the others under any policy, and the conversations that replace them
    start cold too. That start-up is a fixed share of a short trace but a vanishing one of a
    service's life, so the tail after it is reported apart (beside, not instead of, the p99 of
    all requests)."""
    ordered = sorted(results, key=lambda r: r.sent_at)
    opening = ordered[:concurrency]
    if not opening:
        return []
    served = max(r.sent_at + r.latency_s for r in opening)
    return [r for r in ordered[concurrency:] if r.sent_at >= served]
