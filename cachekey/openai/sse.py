"""Server-sent events as OpenAI streams them: `data: <json>` events, then `data: [DONE]`."""

from __future__ import annotations

SSE_MEDIA_TYPE = "text/event-stream"
DATA = b"data: "
DONE_EVENT = b"data: [DONE]"  # as split on the blank line between events
DONE = DONE_EVENT + b"\n\n"


def sse_event(payload: bytes) -> bytes:
    """One event carrying `payload` (a JSON document)."""
    return DATA + payload + b"\n\n"
