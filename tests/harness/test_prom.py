"""harness/prom.py is the harness's one Prometheus text parser: it reads a page as
prometheus_client's own parser does, labels with escapes included, and over real HTTP."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from harness.ports import HOST
from harness.prom import Scrape, labels_of, metric_by_labels, metric_total, samples


def _page() -> str:
    r = CollectorRegistry()
    c = Counter("kvgate_requests", "requests", ["replica", "status"], registry=r)
    c.labels("w-1", "200").inc(3)
    c.labels("w-1", "429").inc()
    c.labels('w-"2"\\x\ny', "200").inc(2)  # a value with a quote, a backslash and a newline
    h = Histogram("kvgate_ttft_seconds", "ttft", buckets=(0.1, 1.0), registry=r)
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    return generate_latest(r).decode()


def test_samples_are_prometheus_clients() -> None:
    page = _page()
    theirs = [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(page) for s in f.samples
    ]
    ours = [(n, labels_of(w), v) for n, w, v in samples(page)]
    assert ours == theirs
    s = Scrape.parse(page)
    assert s.total("kvgate_requests_total") == 6
    assert s.buckets["kvgate_ttft_seconds"] == {0.1: 1, 1.0: 3, float("inf"): 4}


def test_metric_total_and_by_labels_over_http() -> None:
    body = _page().encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((HOST, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://{HOST}:{server.server_port}"
        assert metric_total(url, "kvgate_requests_total") == 6
        assert metric_total(url, "absent_total") == 0
        assert metric_by_labels(url, "kvgate_requests_total", "replica", "status") == {
            ("w-1", "200"): 3,
            ("w-1", "429"): 1,
            ('w-"2"\\x\ny', "200"): 2,
        }
    finally:
        server.shutdown()
        server.server_close()
