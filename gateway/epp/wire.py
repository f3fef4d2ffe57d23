"""The endpoint picker protocol on the wire: ext_proc v3 messages, the keys and the metadata.

What the inference extension specifies (docs/kubernetes.md, "The endpoint picker protocol",
with its sources): the picked endpoints go out twice with the same value, as the request
header `x-gateway-destination-endpoint` and as dynamic metadata
`envoy.lb/x-gateway-destination-endpoint`, an ordered `ip:port,ip:port,...` list (the first
is the pick, the rest the fallbacks a retry walks in order). The proxy may restrict the pick to
`envoy.lb.subset_hint/x-gateway-destination-endpoint-subset`, and reports the endpoint that
served the request as `envoy.lb/x-gateway-destination-endpoint-served`. Bodies are exchanged
in FULL_DUPLEX_STREAMED mode: the EPP sends every body back, in chunks of at most 62,000 bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from cachekey.openai_errors import error_body
from gateway.errors import GatewayError

DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Some proxies take at most 64 KiB per streamed chunk; the extension's own EPP sends 62,000.
BODY_CHUNK_BYTES = 62_000


# ---- reading what the proxy sends ----------------------------------------------------------


def header_dict(headers: HeaderMap) -> dict[str, str]:
    """Lower-cased header name -> value (`raw_value` when set, as Envoy sends it)."""
    out: dict[str, str] = {}
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = value
    return out


def _metadata_value(metadata: Metadata, namespace: str, key: str) -> object:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    return ""


def _split_endpoints(value: object) -> list[str]:
    items = value if isinstance(value, list) else [value]
    return [ep.strip() for item in items if isinstance(item, str) for ep in item.split(",")]


def subset_hint(metadata: Metadata) -> list[str] | None:
    """The endpoints the proxy allows (None: no hint; a list, possibly empty, otherwise).

    Proxies send either one comma-separated string or a list of strings.
    """
    value = _metadata_value(metadata, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    return [ep for ep in _split_endpoints(value) if ep]


def served_endpoint(metadata: Metadata) -> str | None:
    """The endpoint that served the request, as the proxy reports it with the response."""
    value = _metadata_value(metadata, DESTINATION_NAMESPACE, SERVED_KEY)
    eps = [ep for ep in _split_endpoints(value) if ep] if value is not None else []
    return eps[0] if eps else None


def endpoint_of(url: str) -> str:
    """`ip:port` of a worker base URL (`http://10.0.0.5:8000` -> `10.0.0.5:8000`)."""
    return url.split("://", 1)[-1].rstrip("/")


# ---- what the EPP answers --------------------------------------------------------------------


def _set_headers(headers: Mapping[str, str]) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()))
            for k, v in headers.items()
        ]
    )


def route_response(endpoints: list[str], headers: Mapping[str, str]) -> ProcessingResponse:
    """The request-headers answer: the endpoint list as header and metadata, route re-picked."""
    destination = ",".join(endpoints)
    metadata = Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: destination}})
    common = CommonResponse(
        header_mutation=_set_headers({DESTINATION_KEY: destination, **headers}),
        clear_route_cache=True,
    )
    return ProcessingResponse(
        request_headers=HeadersResponse(response=common), dynamic_metadata=metadata
    )


def headers_response(headers: Mapping[str, str]) -> ProcessingResponse:
    """The response-headers answer: continue, with `headers` set on the client's response."""
    common = CommonResponse(header_mutation=_set_headers(headers)) if headers else CommonResponse()
    return ProcessingResponse(response_headers=HeadersResponse(response=common))


def body_responses(body: bytes, *, end: bool, response: bool) -> Iterator[ProcessingResponse]:
    """`body` sent back to the proxy in streamed chunks; `end` marks the last one the end."""
    chunks = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    chunks = chunks or [b""]
    for i, chunk in enumerate(chunks):
        streamed = StreamedBodyResponse(body=chunk, end_of_stream=end and i == len(chunks) - 1)
        common = CommonResponse(body_mutation=BodyMutation(streamed_response=streamed))
        if response:
            yield ProcessingResponse(response_body=BodyResponse(response=common))
        else:
            yield ProcessingResponse(request_body=BodyResponse(response=common))


def trailers_response(*, response: bool) -> ProcessingResponse:
    if response:
        return ProcessingResponse(response_trailers=TrailersResponse())
    return ProcessingResponse(request_trailers=TrailersResponse())


def immediate_response(err: GatewayError) -> ProcessingResponse:
    """The proxy answers the client itself: the status and the OpenAI error body."""
    body = error_body(err.status, err.message, param=err.param, code=err.code)
    headers = {"content-type": "application/json", **(err.headers or {})}
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=err.status),  # type: ignore[arg-type]  # enum value = code
            headers=_set_headers(headers),
            body=json.dumps(body).encode(),
            details=err.code or "kvgate_epp",
        )
    )
