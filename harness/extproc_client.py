"""An ext_proc client that plays the proxy's part of the endpoint picker protocol (tests, bench).

It speaks Envoy's ext_proc v3 over gRPC with the generated protos (xds-protos) and replays the
message sequence of body mode FULL_DUPLEX_STREAMED: request headers, the body in chunks (sent
without waiting for answers), the end of stream; then, like the proxy after it forwarded the
request, the response headers (with the served endpoint in `envoy.lb` metadata) and body.
`forward()` does the proxy's forwarding to the picked endpoint with real HTTP.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

_END = object()


def header_map(headers: dict[str, str]) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def metadata(namespace: str, fields: dict) -> Metadata:
    s = Struct()
    s.update(fields)
    md = Metadata()
    md.filter_metadata[namespace].CopyFrom(s)
    return md


def mutation_dict(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {
        h.header.key: (h.header.raw_value.decode() if h.header.raw_value else h.header.value)
        for h in mutation.set_headers
    }


@dataclass
class RequestAnswer:
    """What the EPP answered to the request phase."""

    immediate: pb.ImmediateResponse | None = None
    set_headers: dict[str, str] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    clear_route_cache: bool = False
    body: bytes = b""
    body_chunks: list[int] = field(default_factory=list)  # sizes, as sent back

    @property
    def endpoints(self) -> list[str]:
        return self.set_headers["x-gateway-destination-endpoint"].split(",")

    @property
    def status(self) -> int:
        assert self.immediate is not None
        return self.immediate.status.code


@dataclass
class ResponseAnswer:
    set_headers: dict[str, str]
    body: bytes


class ExtProcCall:
    """One ext_proc stream (one HTTP request through the proxy)."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub, timeout: float = 60.0) -> None:
        self._q: queue.Queue = queue.Queue()
        self._responses = stub.Process(self._requests(), timeout=timeout)
        self.closed = False

    def _requests(self) -> Iterator[pb.ProcessingRequest]:
        while (msg := self._q.get()) is not _END:
            yield msg

    def _send(self, msg: pb.ProcessingRequest) -> None:
        self._q.put(msg)

    def _recv(self) -> pb.ProcessingResponse | None:
        return next(self._responses, None)

    def request(
        self,
        path: str,
        body: bytes | None,
        *,
        headers: dict[str, str] | None = None,
        chunk: int | None = None,
        subset: list[str] | str | None = None,
        method: str = "POST",
    ) -> RequestAnswer:
        """Headers, then `body` in `chunk`-byte pieces (one piece when None), end of stream."""
        h = {":method": method, ":path": path, ":authority": "gw", ":scheme": "http"}
        if body is not None:
            h |= {"content-type": "application/json", "content-length": str(len(body))}
        h |= headers or {}
        h = {k: v for k, v in h.items() if v != ""}  # "" drops a header (a chunked upload)
        msg = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=header_map(h), end_of_stream=body is None)
        )
        if subset is not None:
            msg.metadata_context.CopyFrom(
                metadata("envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": subset})
            )
        self._send(msg)
        if body is not None:
            size = chunk or max(len(body), 1)
            pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                self._send(
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=piece, end_of_stream=last))
                )
        return self._read_request_answer(expect_body=body is not None)

    def _read_request_answer(self, expect_body: bool) -> RequestAnswer:
        ans = RequestAnswer()
        first = self._recv()
        assert first is not None, "the EPP closed the stream without an answer"
        if first.HasField("immediate_response"):
            ans.immediate = first.immediate_response
            assert self._recv() is None, "the stream must end after an immediate response"
            self.closed = True
            return ans
        assert first.HasField("request_headers"), first
        common = first.request_headers.response
        ans.set_headers = mutation_dict(common.header_mutation)
        ans.clear_route_cache = common.clear_route_cache
        ans.metadata = MessageToDict(first.dynamic_metadata)
        while expect_body:
            msg = self._recv()
            assert msg is not None and msg.HasField("request_body"), msg
            streamed = msg.request_body.response.body_mutation.streamed_response
            ans.body += streamed.body
            ans.body_chunks.append(len(streamed.body))
            expect_body = not streamed.end_of_stream
        return ans

    def response(
        self, status: int, headers: dict[str, str], chunks: list[bytes], served: str | None
    ) -> ResponseAnswer:
        """The forwarded request's answer, as the proxy shows it to the EPP."""
        h = {":status": str(status), **headers}
        msg = pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(headers=header_map(h), end_of_stream=not chunks)
        )
        if served is not None:
            msg.metadata_context.CopyFrom(
                metadata("envoy.lb", {"x-gateway-destination-endpoint-served": served})
            )
        self._send(msg)
        got = self._recv()
        assert got is not None and got.HasField("response_headers"), got
        set_headers = mutation_dict(got.response_headers.response.header_mutation)
        for i, c in enumerate(chunks):
            end = i == len(chunks) - 1
            self._send(pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=end)))
        body, more = b"", bool(chunks)
        while more:
            out = self._recv()
            assert out is not None and out.HasField("response_body"), out
            streamed = out.response_body.response.body_mutation.streamed_response
            body += streamed.body
            more = not streamed.end_of_stream
        return ResponseAnswer(set_headers, body)

    def close(self) -> None:
        """The proxy's end of the stream: the EPP sees it end and releases the request."""
        if not self.closed:
            self._q.put(_END)
            assert self._recv() is None
            self.closed = True


class ExtProcClient:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def call(self) -> ExtProcCall:
        return ExtProcCall(self.stub)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ExtProcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def forward(
    call: ExtProcCall, answer: RequestAnswer, path: str, served: str | None = None
) -> tuple[int, list[bytes], ResponseAnswer]:
    """Do the proxy's part: send the EPP's body to `served` (default: the pick), pass the
    answer back through the EPP in the chunks it came in, and end the stream. Returns the
    worker's status, its body chunks and what the EPP sent back."""
    endpoint = served or answer.endpoints[0]
    # As Envoy does: the EPP's header mutation applies to the upstream request (the DP rank, the
    # worker token); content-length is the body's own.
    headers = {"content-type": "application/json"}
    headers |= {k: v for k, v in answer.set_headers.items() if k != "content-length"}
    url = f"http://{endpoint}{path}"
    with httpx.Client(timeout=60) as http, http.stream("POST", url, content=answer.body,
                                                       headers=headers) as resp:  # fmt: skip
        chunks = [c for c in resp.iter_raw() if c]
        relayed = call.response(
            resp.status_code,
            {"content-type": resp.headers.get("content-type", "")},
            chunks,
            served=endpoint,
        )
    call.close()
    return resp.status_code, chunks, relayed


async def exchange(stub: pb_grpc.ExternalProcessorStub, body: bytes | None) -> None:
    """One request's ext_proc exchange as a proxy has it before forwarding: headers, body and
    end of stream out; the endpoint (headers response) and the body back in; stream closed."""
    path, method = ("/v1/chat/completions", "POST") if body is not None else ("/v1/models", "GET")
    headers = pb.HttpHeaders(
        headers=header_map({":method": method, ":path": path}), end_of_stream=body is None
    )
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=headers))
    if body is not None:
        await call.write(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
    first = await call.read()
    assert first.HasField("request_headers"), first  # the pick, not a refusal
    more = body is not None
    while more:
        msg = await call.read()
        more = not msg.request_body.response.body_mutation.streamed_response.end_of_stream
    await call.done_writing()
    await call.read()  # the stream's end: the EPP releases the request
