"""A do-nothing endpoint picker for bench.epp_overhead: what the protocol alone costs.

kvgate's own ext_proc transport (gateway/epp/rpc.py over h2.py, on uvloop as in
`python -m gateway`) with a handler that decides nothing: it names one fixed endpoint as soon as
the body is whole, sends the body back unchanged, and answers the response phase as the EPP does
(a JSON answer's headers with its body, the stream ended after the last message). No parsing,
rendering, keys or ranking: behind Envoy it measures the two ext_proc round trips a request
costs before any routing work.

    python -m bench.lib.extproc_null --port 9100 --endpoint 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import uvloop
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from gateway.epp import wire
from gateway.epp.rpc import Call, Method, RpcServer

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def handler(endpoint: str):
    async def process(requests: AsyncIterator, call: Call) -> AsyncIterator:
        body, held = bytearray(), None
        async for msg in requests:
            kind = msg.WhichOneof("request")
            if kind == "request_headers" and msg.request_headers.end_of_stream:
                yield wire.route_response([endpoint], {})
            elif kind == "request_body":
                body += msg.request_body.body
                if msg.request_body.end_of_stream:
                    yield wire.route_response([endpoint], {"content-length": str(len(body))})
                    for out in wire.body_responses(bytes(body), end=True, response=False):
                        yield out
            elif kind == "response_headers":
                held = wire.headers_response({})
                if msg.response_headers.end_of_stream:
                    yield held
                    return
            elif kind == "response_body":
                if held is not None:
                    yield held
                    held = None
                b = msg.response_body
                for out in wire.body_responses(b.body, end=b.end_of_stream, response=True):
                    yield out
                if b.end_of_stream:
                    return

    return process


async def serve(port: int, endpoint: str) -> None:
    server = RpcServer({PROCESS: Method(ProcessingRequest.FromString, handler(endpoint))},
                       max_message_bytes=64 << 20)  # fmt: skip
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--endpoint", required=True, help="ip:port every request is sent to")
    args = ap.parse_args()
    uvloop.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
