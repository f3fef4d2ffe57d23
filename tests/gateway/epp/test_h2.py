"""The EPP's own gRPC transport (gateway/epp/h2.py, rpc.py, health.py) against real clients.

grpcio's client (gRPC's C core, an independent HTTP/2 and gRPC implementation) drives messages
larger than a frame and than the flow-control windows both ways, many streams at once, status
and details, cancellation, the message limit, health Check and Watch, and a graceful stop.
Hand-written frames (the layout from RFC 9113, headers from python-hyper's HPACK encoder) check
what a well-behaved client never does: a tiny window, a broken preface, an oversized frame, a
header block that does not decode, a reset stream, PING.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import hpack
import pytest
import uvloop
from google.protobuf.wrappers_pb2 import BytesValue
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.h2_frames import RESET_FLOOR
from gateway.epp.health import NOT_SERVING, SERVING, Health
from gateway.epp.rpc import Call, Method, RpcServer, Status
from harness.ports import HOST, free_port
from harness.waits import wait_until

ECHO = "/test.Echo/Echo"
EVENTS: list[str] = []  # what the handlers saw happen, in the server's thread


async def echo(requests: AsyncIterator, call: Call) -> AsyncIterator:
    """Each request back; b"abort:..." ends the call with INVALID_ARGUMENT and that text;
    b"hang" waits until cancelled; b"big:N" answers N bytes."""
    try:
        async for req in requests:
            v = req.value
            if v.startswith(b"abort:"):
                await call.abort(Status.INVALID_ARGUMENT, v[6:].decode())
            if v == b"hang":
                await asyncio.sleep(3600)
            if v.startswith(b"big:"):
                v = bytes(range(256)) * (int(v[4:]) // 256)
            yield BytesValue(value=v)
    except asyncio.CancelledError:
        EVENTS.append("cancelled")
        raise
    finally:
        EVENTS.append("done")


@contextlib.contextmanager
def serving(max_message: int = 8 << 20) -> Iterator[tuple[int, RpcServer, Health, object]]:
    """An RpcServer with the echo method and health, on uvloop (as in `python -m gateway`), in
    a thread of its own."""
    loop = uvloop.new_event_loop()
    health = Health()
    server = RpcServer({ECHO: Method(BytesValue.FromString, echo), **health.methods()},
                       max_message)  # fmt: skip
    port = free_port()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start(HOST, port))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    EVENTS.clear()
    try:
        yield port, server, health, loop
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def echo_stub(channel: grpc.Channel):
    return channel.stream_stream(
        ECHO,
        request_serializer=BytesValue.SerializeToString,
        response_deserializer=BytesValue.FromString,
    )


def values(*vs: bytes) -> Iterator[BytesValue]:
    return (BytesValue(value=v) for v in vs)


def test_messages_larger_than_frames_and_windows_both_ways() -> None:
    # 3 MiB each way: many 16 KiB frames, past the server's 1 MiB stream window (it must give
    # window back as it reads) and past the client's initial 64 KiB window (it must wait for
    # the client's WINDOW_UPDATEs); small messages around them keep their order.
    big = bytes(range(256)) * (3 << 12)
    with serving() as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        got = list(echo_stub(ch)(values(b"a", big, b"b", b"big:3145728"), timeout=60))
        assert [len(m.value) for m in got] == [1, len(big), 1, 3 << 20]
        assert got[1].value == big and got[3].value == big


def test_streams_at_once_keep_apart() -> None:
    with serving() as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        stub = echo_stub(ch)
        calls = [stub(values(*(f"{i}:{j}".encode() for j in range(20))), timeout=60)
                 for i in range(40)]  # fmt: skip
        for i, call in enumerate(calls):
            assert [m.value for m in call] == [f"{i}:{j}".encode() for j in range(20)]


def test_status_details_unknown_method_and_message_limit() -> None:
    with serving(max_message=1000) as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        details = "bad input: 100% wrong, naïve\nsecond line"
        with pytest.raises(grpc.RpcError) as info:
            list(echo_stub(ch)(values(b"x", f"abort:{details}".encode()), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == details

        other = ch.unary_unary("/test.Echo/Nope", request_serializer=BytesValue.SerializeToString,
                               response_deserializer=BytesValue.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            other(BytesValue(value=b"x"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED

        with pytest.raises(grpc.RpcError) as info:
            list(echo_stub(ch)(values(b"y" * 2000), timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 1000" in info.value.details()
        # The connection is still good.
        assert [m.value for m in echo_stub(ch)(values(b"ok"), timeout=10)] == [b"ok"]


def test_a_cancelled_call_cancels_its_handler() -> None:
    with serving() as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        call = echo_stub(ch)(values(b"first", b"hang"), timeout=60)
        assert next(call).value == b"first"
        call.cancel()
        wait_until(lambda: EVENTS == ["cancelled", "done"], 10, f"handler not cancelled: {EVENTS}")


def test_health_check_and_watch() -> None:
    with serving() as (port, _, health, loop), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest
        loop.call_soon_threadsafe(health.set, "readiness", NOT_SERVING)
        wait_until(lambda: _status(stub, "readiness") == NOT_SERVING, 10, "readiness never set")
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(req(service="nope"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        watch = stub.Watch(req(service="readiness"), timeout=30)
        assert next(watch).status == NOT_SERVING
        loop.call_soon_threadsafe(health.set, "readiness", SERVING)
        assert next(watch).status == SERVING
        loop.call_soon_threadsafe(health.enter_graceful_shutdown)
        assert next(watch).status == NOT_SERVING
        loop.call_soon_threadsafe(health.set, "readiness", SERVING)  # ignored from now on
        time.sleep(0.2)
        assert _status(stub, "readiness") == NOT_SERVING
        watch.cancel()
        unknown = stub.Watch(req(service="nope"), timeout=10)
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()


def _status(stub, service: str) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_stop_drains_then_cancels() -> None:
    with serving() as (port, server, _, loop), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        stub = echo_stub(ch)
        hanging = stub(values(b"first", b"hang"), timeout=60)
        assert next(hanging).value == b"first"
        t0 = time.monotonic()
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(30)
        assert 0.9 < time.monotonic() - t0 < 8
        with pytest.raises(grpc.RpcError) as info:
            next(hanging)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert EVENTS == ["cancelled", "done"]
        with pytest.raises(grpc.RpcError):  # no new calls: the port is closed
            list(stub(values(b"late"), timeout=5))


# ---- hand-written frames ----------------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


class RawClient:
    def __init__(self, port: int, settings: bytes = b"") -> None:
        self.sock = socket.create_connection((HOST, port), timeout=10)
        self.buf = b""
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def open(self, stream: int, path: str = ECHO) -> None:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", "t"), ("content-type", "application/grpc"),
                                     ("te", "trailers")])  # fmt: skip
        self.send(frame(HEADERS, 0x4, stream, block))

    def message(self, stream: int, value: bytes, end: bool = False) -> None:
        msg = BytesValue(value=value).SerializeToString()
        self.send(frame(DATA, 0x1 if end else 0, stream, b"\0" + struct.pack(">I", len(msg)) + msg))

    def read_frame(self) -> tuple[int, int, int, bytes] | None:
        """(type, flags, stream, payload); None when the server closed the connection."""
        while True:
            if len(self.buf) >= 9:
                n = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + n:
                    kind, flags = self.buf[3], self.buf[4]
                    stream = int.from_bytes(self.buf[5:9], "big")
                    payload, self.buf = self.buf[9 : 9 + n], self.buf[9 + n :]
                    return kind, flags, stream, payload
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk

    def until(self, kind: int) -> tuple[int, int, int, bytes]:
        while (f := self.read_frame()) is not None:
            if f[0] == kind:
                return f
        raise AssertionError(f"the connection closed before a frame of type {kind}")

    def goaway_code(self) -> int:
        f = self.until(GOAWAY)
        assert self.read_frame() is None, "the connection must close after GOAWAY"
        return int.from_bytes(f[3][4:8], "big")


def test_flow_control_holds_data_to_the_window() -> None:
    # INITIAL_WINDOW_SIZE 100: the server may send 100 bytes of DATA on the stream, no more,
    # until a WINDOW_UPDATE; then the rest, then the trailers.
    with serving() as (port, *_):
        c = RawClient(port, settings=struct.pack(">HI", 4, 100))
        c.open(1)
        c.message(1, b"big:1024", end=True)
        sent = 0
        deadline = time.monotonic() + 1.0
        c.sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                f = c.read_frame()
            except TimeoutError:
                continue
            assert f is not None
            if f[0] == DATA:
                sent += len(f[3])
        assert sent == 100, sent
        c.sock.settimeout(10)
        c.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 10_000)))
        while (f := c.read_frame()) is not None and not (f[0] == HEADERS and f[1] & 0x1):
            if f[0] == DATA:
                sent += len(f[3])
        assert f is not None, "no trailers"
        assert dict(c.decoder.decode(f[3]))["grpc-status"] == "0"
        assert sent == 5 + BytesValue(value=bytes(1024)).ByteSize()  # all of it, once


def test_ping_and_a_reset_stream() -> None:
    with serving() as (port, *_):
        c = RawClient(port)
        c.send(frame(PING, 0, 0, b"12345678"))
        assert c.until(PING)[1:] == (0x1, 0, b"12345678")
        c.open(1)
        c.message(1, b"first")
        c.message(1, b"hang")
        assert c.until(DATA)[3].endswith(b"first")  # the handler runs; it waits now
        c.send(frame(RST_STREAM, 0, 1, struct.pack(">I", 8)))  # CANCEL
        wait_until(lambda: EVENTS == ["cancelled", "done"], 10, f"handler not cancelled: {EVENTS}")
        c.open(3)  # the connection goes on
        c.message(3, b"again", end=True)
        f = c.until(DATA)
        assert f[2] == 3 and f[3].endswith(b"again")


def test_rapid_reset_closes_the_connection() -> None:
    # Streams opened and reset at once (CVE-2023-44487): past RESET_FLOOR streams with half or
    # more reset unanswered, GOAWAY ENHANCE_YOUR_CALM. A client that resets some of its streams
    # (a third, here) keeps its connection; the server serves everyone else as before.
    with serving() as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        polite = RawClient(port)
        for i in range(RESET_FLOOR):
            stream = 2 * i + 1
            polite.open(stream)
            polite.message(stream, b"hang" if i % 3 == 0 else b"ok", end=i % 3 != 0)
            if i % 3 == 0:
                polite.send(frame(RST_STREAM, 0, stream, struct.pack(">I", 8)))
            else:
                while (f := polite.read_frame()) is not None and not (f[2] == stream and f[1] & 1):
                    pass
        polite.open(2 * RESET_FLOOR + 1)
        polite.message(2 * RESET_FLOOR + 1, b"still", end=True)
        assert polite.until(DATA)[3].endswith(b"still")

        rude = RawClient(port)
        for i in range(RESET_FLOOR):
            rude.open(2 * i + 1)
            rude.send(frame(RST_STREAM, 0, 2 * i + 1, struct.pack(">I", 8)))
        assert rude.goaway_code() == 0xB  # ENHANCE_YOUR_CALM
        assert [m.value for m in echo_stub(ch)(values(b"others"), timeout=10)] == [b"others"]


@pytest.mark.parametrize(
    ("first", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0x1),  # not HTTP/2: PROTOCOL_ERROR
        (PREFACE + frame(SETTINGS, 0, 0) + frame(DATA, 0, 1, b"x" * 20_000), 0x6),  # FRAME_SIZE
        (PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0x4, 1, b"\xff\xff\xff\xff"), 0x9),
        (PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0x4, 2, b"\x83"), 0x1),  # even stream
    ],
    ids=["http1", "oversized-frame", "bad-hpack", "even-stream"],
)
def test_protocol_errors_end_the_connection_only(first: bytes, code: int) -> None:
    with serving() as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        s = socket.create_connection((HOST, port), timeout=10)
        s.sendall(first)
        c = RawClient.__new__(RawClient)
        c.sock, c.buf = s, b""
        assert c.goaway_code() == code
        # The server serves everyone else as before.
        assert [m.value for m in echo_stub(ch)(values(b"still here"), timeout=10)] == [
            b"still here"
        ]


def test_a_client_that_reads_nothing_is_cut_off(caplog: pytest.LogCaptureFixture) -> None:
    # PINGs, never reading the ACKs: once the server's unsent answers pass its bound the
    # connection goes (its memory stays bounded), and the server serves others as before.
    with serving() as (port, *_), grpc.insecure_channel(f"{HOST}:{port}") as ch:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((HOST, port))
        s.sendall(PREFACE + frame(SETTINGS, 0, 0))
        burst = frame(PING, 0, 0, b"12345678") * 50_000
        t0 = time.monotonic()
        with pytest.raises(OSError):  # reset by the server
            while time.monotonic() - t0 < 120:
                s.sendall(burst)
        s.close()
        assert any("reads none of its answers" in r.getMessage() for r in caplog.records)
        assert [m.value for m in echo_stub(ch)(values(b"ok"), timeout=10)] == [b"ok"]
