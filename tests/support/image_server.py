"""A malicious image server on 127.0.0.1 for the fetch tests: slow, huge, compressed, broken.

Routes (GET):
  /img/<name>?delay=S  the PNG registered under <name>, after S seconds
  /drip?every=S        200 and a Content-Length of 1 MiB, then one byte every S seconds
  /stall?after=S       200 and a Content-Length of 1 MiB, one byte after S seconds, then silence
  /bomb                a gzip body inflating to 200 MiB, sent with Content-Encoding: gzip
  /bomb-raw            the same bytes, without a Content-Encoding header
  /to?u=URL            302 to URL
  /status/<code>       that status, empty body
  /cut                 Content-Length 1000, 10 bytes, then the connection closes
  /garbage             bytes that are not HTTP
Every request's path and headers are recorded in `hits`.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

BOMB_INFLATED = 200 * 2**20


def gzip_bomb(size: int = BOMB_INFLATED) -> bytes:
    """gzip of `size` zero bytes (about 1/1000 of it), built without holding `size` bytes."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    zeros = bytes(2**20)
    out = [comp.compress(zeros) for _ in range(size // len(zeros))]
    return b"".join([*out, comp.flush()])


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients hanging up mid-request is what these tests do


class ImageServer:
    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.images: dict[str, bytes] = {}
        self.hits: list[tuple[str, dict[str, str]]] = []
        self.bomb = gzip_bomb()
        self._stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.hits.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                # The fetcher hanging up early is the point of most routes.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    outer._route(self, url.path, query)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, name: str, data: bytes) -> str:
        self.images[name] = data
        return f"{self.base}/img/{name}"

    def _route(self, h: BaseHTTPRequestHandler, path: str, query: dict[str, str]) -> None:
        if path.startswith("/img/"):
            time.sleep(float(query.get("delay", 0)))
            self._send(h, 200, self.images[path[len("/img/") :]])
        elif path == "/drip":
            h.send_response(200)
            h.send_header("Content-Length", str(2**20))
            h.end_headers()
            every = float(query.get("every", 0.3))
            for _ in range(200):  # ends by itself, long after any fetch gave up
                if self._stop.wait(every):
                    return
                h.wfile.write(b"x")
                h.wfile.flush()
        elif path == "/stall":
            h.send_response(200)
            h.send_header("Content-Length", str(2**20))
            h.end_headers()
            if not self._stop.wait(float(query["after"])):
                h.wfile.write(b"x")
                h.wfile.flush()
                self._stop.wait(30)
        elif path in ("/bomb", "/bomb-raw"):
            extra = {"Content-Encoding": "gzip"} if path == "/bomb" else {}
            self._send(h, 200, self.bomb, extra)
        elif path == "/to":
            self._send(h, 302, b"", {"Location": query["u"]})
        elif path.startswith("/status/"):
            self._send(h, int(path.rsplit("/", 1)[1]), b"")
        elif path == "/cut":
            h.send_response(200)
            h.send_header("Content-Length", "1000")
            h.end_headers()
            h.wfile.write(b"0123456789")
            h.close_connection = True
        elif path == "/garbage":
            h.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n" + bytes(range(256)) * 4)
            h.close_connection = True
        else:
            self._send(h, 404, b"")

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Content-Type", "image/png")
        h.end_headers()
        h.wfile.write(body)

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
