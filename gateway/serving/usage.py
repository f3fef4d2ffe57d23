"""The usage an answer reports: read from a whole answer's body, or from a stream's usage
chunk as it passes (which the HTTP relay hides again when the client did not ask for it)."""

from __future__ import annotations

import json

import msgspec

from cachekey.openai.sse import DONE_EVENT

_ERROR_EVENT = b'data: {"error"'  # how a worker reports a failure in-band (vLLM's shape)


class SSERelay:
    """Relays a worker's SSE stream, reading the usage chunk and hiding it if unasked for."""

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict | None = None
        self.saw_done = False
        self.saw_error = False  # the worker ended its stream with an error event
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        if b"\n\n" not in self._buf:
            return b""
        head, _, self._buf = self._buf.rpartition(b"\n\n")
        out = []
        for event in head.split(b"\n\n"):
            if self._keep(event):
                out.append(event + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if event.startswith(DONE_EVENT):
            self.saw_done = True
            return True
        if event.startswith(_ERROR_EVENT):
            self.saw_error = True
            return True
        if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
            return True
        try:
            data = json.loads(event[event.index(b"{") :])
        except ValueError:
            return True
        usage = data.get("usage") if isinstance(data, dict) else None
        if usage:
            self.usage = usage
            if self.strip_usage and not data.get("choices"):
                return False
        return True


class _Answer(msgspec.Struct):
    """The one field of a worker's answer the gateway reads (the rest is skipped unparsed)."""

    usage: dict | None = None


_ANSWER = msgspec.json.Decoder(_Answer)


def read_usage(status: int, content: bytes) -> dict | None:
    if status != 200:
        return None
    try:
        return _ANSWER.decode(content).usage
    except msgspec.DecodeError:
        return None
