"""Open-loop load: each request is sent at its arrival time, whatever the answers so far.

Arrivals are a Poisson process at `rate` requests/s (seeded). A conversation's next turn is sent
at its arrival time or as soon as its previous turn is answered, whichever is later (a user reads
the answer before typing). Requests go to several gateways in turn, over keep-alive connections
of a small HTTP/1.1 client: the client shares the machine with what it measures, so it must stay
cheap (the `openai` client costs several times the gateway's own CPU per request).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec


@dataclass(frozen=True, slots=True)
class TraceRequest:
    conversation: int
    body: bytes  # an OpenAI chat request, JSON


@dataclass(slots=True)
class Outcome:
    due: float  # seconds after the start it was to be sent
    sent: float = 0.0
    done: float = 0.0
    status: int = 0  # 0: no answer (timeout, connection lost)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted: int | None = None  # x-kvgate-predicted-cached-tokens
    replica: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_answer = msgspec.json.Decoder(_Answer)


def usage_of(body: bytes) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of an OpenAI answer."""
    usage = _answer.decode(body).usage or _Usage()
    return usage.prompt_tokens, (usage.prompt_tokens_details or _Details()).cached_tokens


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0


# A server closes a keep-alive connection after a while (uvicorn: 5 s); one idle that long is
# not reused, and one the server closed just as it was reused is replaced once.
_MAX_IDLE_S = 2.0


class Target:
    """Keep-alive connections to one gateway."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
            f"Content-Type: application/json\r\n{extra}Content-Length: "
        ).encode()
        self._idle: deque[_Conn] = deque()

    async def post(self, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, body)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                    raise  # the server answered part of it: not a connection it had closed
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=2**22)
        return await self._exchange(_Conn(reader, writer), body)

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < _MAX_IDLE_S:
                return conn
            conn.writer.close()
        return None

    async def _exchange(self, conn: _Conn, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        try:
            conn.writer.write(self._head + b"%d\r\n\r\n" % len(body) + body)
            status, headers, data = await _read_response(conn.reader)
        except BaseException:
            conn.writer.close()
            raise
        if headers.get(b"connection", b"").lower() == b"close":
            conn.writer.close()
        else:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        return status, headers, data

    def close(self) -> None:
        while self._idle:
            self._idle.pop().writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readuntil(b"\r\n")  # the last chunk's line end (no trailers sent)
        return status, headers, b"".join(parts)
    raise ConnectionError("an answer with neither a length nor chunks")


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """`n` Poisson arrivals at `rate` per second, from 0."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_open_loop(
    gateways: Sequence[str],
    trace: Sequence[TraceRequest],
    rate: float,
    *,
    seed: int = 0,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
    progress: Callable[[list[Outcome], float], None] | None = None,
) -> list[Outcome]:
    """Send the trace at `rate`; one outcome per request, in trace order. `progress` is called
    about every 5 s with the outcomes so far and the seconds since the start."""
    targets = [Target(g, headers or {}) for g in gateways]
    due = arrival_times(len(trace), rate, seed)
    outcomes = [Outcome(d) for d in due]
    previous: dict[int, asyncio.Future[None]] = {}
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []

    async def send(i: int, before: asyncio.Future[None] | None, done: asyncio.Future[None]):
        out = outcomes[i]
        try:
            if before is not None:
                await before
            out.sent = loop.time() - start
            status, hdrs, body = await asyncio.wait_for(
                targets[i % len(targets)].post(trace[i].body), timeout
            )
            out.status = status
            predicted = hdrs.get(b"x-kvgate-predicted-cached-tokens")
            out.predicted = int(predicted) if predicted is not None else None
            out.replica = hdrs.get(b"x-kvgate-replica", b"").decode()
            if status == 200:
                out.prompt_tokens, out.cached_tokens = usage_of(body)
            else:
                out.error = body[:300].decode(errors="replace")
        except Exception as e:  # counted, never hidden: a failed request is an outcome
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.done = loop.time() - start
            done.set_result(None)

    next_report = 5.0
    for i, req in enumerate(trace):
        wait = start + due[i] - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        done: asyncio.Future[None] = loop.create_future()
        tasks.append(asyncio.create_task(send(i, previous.get(req.conversation), done)))
        previous[req.conversation] = done
        if progress is not None and loop.time() - start >= next_report:
            progress(outcomes[: i + 1], loop.time() - start)
            next_report += 5.0
    await asyncio.gather(*tasks)
    for t in targets:
        t.close()
    return outcomes


def describe_progress(outcomes: list[Outcome], elapsed: float) -> str:
    """`sent / answered / failed / in flight` so far, for a line of progress output."""
    answered = sum(1 for o in outcomes if o.done)
    failed = sum(1 for o in outcomes if o.done and not o.ok)
    return (
        f"  {elapsed:6.0f}s: {len(outcomes)} due, {answered} answered, {failed} failed, "
        f"{len(outcomes) - answered} in flight"
    )
