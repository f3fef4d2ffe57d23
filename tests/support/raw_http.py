"""One HTTP/1.1 response read off a raw socket: for tests that send what no HTTP client sends
(partial bodies, lying lengths) and must read the answer the same way."""

from __future__ import annotations

import socket


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed mid-head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body
