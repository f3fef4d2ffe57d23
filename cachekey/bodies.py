"""Request bodies being read, bounded in time and, across connections, in bytes: one
implementation for the gateway (gateway/limits.py `read_body`) and the worker
(worker/server/body_guard.py), with the same flags and the same refusals.

A server reads a body after its headers are in, and nothing else bounded how long a client may
take to send it nor how many such bodies are held at once: a client that sent a Content-Length
and then part of the body, or none, kept its connection, its task and the bytes it sent for
ever, and `--max-body-bytes` bounds only one body. So:

- `--body-read-timeout`: the body must be whole this many seconds after its headers, else a
  408 (`BodyTimeout`), and the connection is closed, since the rest of the body is never read;
- `--body-read-budget`: the bytes of all the bodies being read at once (on the gateway, and of
  those read whole and waiting for a slot: gateway/serving/exchange.py gives them back). A
  chunk that would pass it, or a body whose declared length would not fit now, is a 429 with
  Retry-After, the way the gateway answers every overload. It counts the bytes that arrived,
  not the lengths declared: a declared length costs a client nothing, so counting it would let
  a few idle connections refuse every other body.
"""

from __future__ import annotations

from cachekey.openai.errors import RATE_LIMIT_EXCEEDED, REQUEST_TIMEOUT, APIError

BUDGET_FLAG = "--body-read-budget"
TIMEOUT_FLAG = "--body-read-timeout"
DEFAULT_BUDGET_BODIES = 4  # the budget, in bodies of --max-body-bytes, when none is given
DEFAULT_TIMEOUT_S = 30.0


class BodyTimeout(APIError):
    """The body was not whole within the deadline: 408."""

    def __init__(self, seconds: float, received: int) -> None:
        super().__init__(
            408,
            f"request body read time: over the limit of {seconds:g} s, {received} bytes "
            f"received ({TIMEOUT_FLAG})",
            param="body",
            code=REQUEST_TIMEOUT,
        )


class BodyBudget:
    """The bytes of the request bodies being read, across all connections, and their bound.

    Each read calls `check` once with its declared length, `take` for each chunk before it
    keeps it, and `give` with what it took when it ends, however it ends. A plain counter on
    the event loop: no lock, nothing per request but the additions.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"{BUDGET_FLAG} must be positive")
        self.limit = limit
        self.used = 0

    def check(self, declared: int) -> None:
        """A body whose declared length does not fit now is refused before it is read."""
        if self.used + declared > self.limit:
            raise self._full(declared)

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise self._full(n)
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n

    def _full(self, n: int) -> APIError:
        return APIError(
            429,
            f"request bodies being read: {self.used} + {n} bytes > limit {self.limit} "
            f"({BUDGET_FLAG})",
            code=RATE_LIMIT_EXCEEDED,
            headers={"retry-after": "1"},
        )


def budget_bytes(budget: int | None, max_body_bytes: int) -> int:
    """The budget a config names, or DEFAULT_BUDGET_BODIES bodies of the largest size."""
    limit = DEFAULT_BUDGET_BODIES * max_body_bytes if budget is None else budget
    if limit < max_body_bytes:
        raise ValueError(f"{BUDGET_FLAG} must be at least --max-body-bytes ({max_body_bytes})")
    return limit
