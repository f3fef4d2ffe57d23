"""The EPP's gRPC server in process: TLS, health as the protocol defines it, protocol errors."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.epp import EppServer
from gateway.state import GatewayState
from harness.extproc_client import header_map
from harness.ports import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "tls.crt", d / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_health_and_refusals(tls_pair: tuple[Path, Path]) -> None:
    cert, key = tls_pair
    port = free_port()
    config = GatewayConfig(
        epp=True, epp_port=port, epp_tls_cert_file=str(cert), epp_tls_key_file=str(key)
    )
    asyncio.run(_scenario(config, port, cert.read_bytes()))


async def _scenario(config: GatewayConfig, port: int, root: bytes) -> None:
    state = GatewayState.build(config)
    server = EppServer(state, "127.0.0.1", port)
    await server.start()
    creds = grpc.ssl_channel_credentials(root_certificates=root)
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def status(service: str) -> int:
                req = health_pb2.HealthCheckRequest(service=service)
                return (await health.Check(req, timeout=10)).status

            # Alive at once; ready once discovery delivered the worker set (even an empty one).
            assert await status("liveness") == SERVING
            assert await status("readiness") == NOT_SERVING
            await state.replicas.set_workers(frozenset())
            await server.mark_synced()
            assert await status("readiness") == SERVING
            assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == SERVING

            stub = pb_grpc.ExternalProcessorStub(ch)
            # No worker at all: the answer is a 503 the proxy returns as it is.
            body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
            headers = {":method": "POST", ":path": "/v1/chat/completions"}
            msgs = [
                pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(headers))),
                pb.ProcessingRequest(
                    request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)
                ),
            ]
            got = [m async for m in stub.Process(iter(msgs), timeout=10)]
            assert len(got) == 1 and got[0].immediate_response.status.code == 503
            err = json.loads(got[0].immediate_response.body)["error"]
            assert (
                err["code"] == "no_healthy_worker" and "no worker is configured" in err["message"]
            )

            # Out of order (a body before any headers): the stream is refused, not answered.
            bad = [pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [m async for m in stub.Process(iter(bad), timeout=10)]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0)
        await state.close()


def test_tls_flags_go_together() -> None:
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig(epp_tls_cert_file="/x.crt")


def test_epp_mode_does_not_import_torch() -> None:
    code = (
        "import sys, gateway.epp, gateway.epp.stream, gateway.discovery.inferencepool\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
