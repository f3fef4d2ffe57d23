"""The listening socket of `python -m gateway` and `python -m worker`, bound before serving."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket listening on host:port; a clash raises OSError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and without it
    # a response written in two parts waits ~40 ms for the client's delayed ACK on keep-alive.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening before the app is up means early clients queue instead of being refused.
        sock.listen(2048)
    except OSError as e:
        sock.close()
        reason = (e.strerror or str(e)).lower()
        raise OSError(f"cannot listen on {host}:{port} ({flag} {port}): {reason}") from None
    return sock
