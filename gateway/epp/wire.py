"""The endpoint picker protocol on the wire: ext_proc v3 messages, the keys and the metadata.

What the inference extension specifies (docs/kubernetes.md, "The endpoint picker protocol",
with its sources): the pick goes out twice with the same value, as the request header
`x-gateway-destination-endpoint` and as dynamic metadata `envoy.lb/x-gateway-destination-endpoint`:
one `ip:port` by default, or an ordered `ip:port,ip:port,...` list (the pick, then the fallbacks
a retrying proxy walks) with --epp-fallbacks. The proxy may restrict the pick to
`envoy.lb.subset_hint/x-gateway-destination-endpoint-subset`, and reports the endpoint that
served the request as `envoy.lb/x-gateway-destination-endpoint-served`. Envoy may also send the
ext_proc attributes `upstream.address` and `response.code_details` with the response headers.
In FULL_DUPLEX_STREAMED mode the EPP sends every body back, in chunks of at most 62,000 bytes;
in BUFFERED and STREAMED modes it answers each body message once, replacing or keeping it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
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
from google.protobuf.struct_pb2 import Struct, Value

from cachekey.headers import DESTINATION_KEY, SERVED_KEY, SUBSET_KEY
from cachekey.openai.errors import APIError, error_body

DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Request headers only the proxy and the EPP may set: a client's own are removed (or, for the
# destination, overwritten) in every headers answer, so that a client never steers its request.
CLIENT_FORBIDDEN = (DESTINATION_KEY, SERVED_KEY, SUBSET_KEY, f"{DESTINATION_KEY}-fallback")
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"  # where Envoy puts the ext_proc attributes
VIA_UPSTREAM = "via_upstream"  # response.code_details of an answer that came from the upstream
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


def attribute(msg, name: str) -> str | None:
    """An ext_proc attribute the proxy sent with `msg` (Envoy's `response_attributes`), as text."""
    if ATTRIBUTES_NAMESPACE not in msg.attributes:
        return None
    fields = msg.attributes[ATTRIBUTES_NAMESPACE].fields
    if name not in fields:
        return None
    value = fields[name]
    return value.string_value if value.WhichOneof("kind") == "string_value" else None


def body_modes(first) -> tuple[int | None, int | None]:
    """The (request, response) body modes of the proxy's `protocol_config` (None: not sent)."""
    if not first.HasField("protocol_config"):
        return None, None
    pc = first.protocol_config
    return pc.request_body_mode, pc.response_body_mode


def endpoint_of(url: str) -> str:
    """`ip:port` of a worker base URL (`http://10.0.0.5:8000` -> `10.0.0.5:8000`)."""
    return url.split("://", 1)[-1].rstrip("/")


# ---- what the EPP answers --------------------------------------------------------------------


_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set_headers(headers: Mapping[str, str], remove: tuple[str, ...] = ()) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in headers.items()
        ],
        remove_headers=list(remove),
    )


def _route_mutation(endpoints: list[str], headers: Mapping[str, str]):
    """The pick as a header mutation (the client's own routing headers removed) and metadata."""
    destination = ",".join(endpoints)
    # Built from the values (C), not with Struct.update (Python, per key): the per-request path.
    pick = Struct(fields={DESTINATION_KEY: Value(string_value=destination)})
    metadata = Struct(fields={DESTINATION_NAMESPACE: Value(struct_value=pick)})
    mutation = _set_headers({DESTINATION_KEY: destination, **headers}, CLIENT_FORBIDDEN[1:])
    return mutation, metadata


def route_response(
    endpoints: list[str], headers: Mapping[str, str], mode_override: ProcessingMode | None = None
) -> ProcessingResponse:
    """The request-headers answer: the endpoint list as header and metadata, route re-picked."""
    mutation, metadata = _route_mutation(endpoints, headers)
    common = CommonResponse(header_mutation=mutation, clear_route_cache=True)
    return ProcessingResponse(
        request_headers=HeadersResponse(response=common),
        dynamic_metadata=metadata,
        mode_override=mode_override,
    )


def continue_request_headers(mode_override: ProcessingMode | None = None) -> ProcessingResponse:
    """The request-headers answer before the pick (BUFFERED): the client's routing headers go."""
    common = CommonResponse(header_mutation=HeaderMutation(remove_headers=list(CLIENT_FORBIDDEN)))
    return ProcessingResponse(
        request_headers=HeadersResponse(response=common), mode_override=mode_override
    )


def routed_body_responses(
    endpoints: list[str], headers: Mapping[str, str], payload: bytes, messages: int
) -> Iterator[ProcessingResponse]:
    """BUFFERED/STREAMED: one answer per body message received. The first carries the pick
    (applied while the proxy still holds the request headers) and the whole new body; the
    others clear their message's bytes."""
    mutation, metadata = _route_mutation(endpoints, headers)
    common = CommonResponse(
        header_mutation=mutation,
        body_mutation=BodyMutation(body=payload),
        clear_route_cache=True,
    )
    yield ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=metadata)
    for _ in range(messages - 1):
        cleared = CommonResponse(body_mutation=BodyMutation(clear_body=True))
        yield ProcessingResponse(request_body=BodyResponse(response=cleared))


def body_unchanged(*, response: bool) -> ProcessingResponse:
    """BUFFERED/STREAMED: a body message goes on as it is."""
    if response:
        return ProcessingResponse(response_body=BodyResponse(response=CommonResponse()))
    return ProcessingResponse(request_body=BodyResponse(response=CommonResponse()))


def buffered_mode(response_body_mode: int | None) -> ProcessingMode:
    """STREAMED requests: ask the proxy to buffer the request body instead (Envoy honours it
    with `allow_mode_override: true`), the response phase as configured."""
    return ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        request_body_mode=ProcessingMode.BUFFERED,
        request_trailer_mode=ProcessingMode.SKIP,
        response_header_mode=ProcessingMode.SEND,
        response_body_mode=response_body_mode or ProcessingMode.NONE,
        response_trailer_mode=ProcessingMode.SKIP,
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


def immediate_response(err: APIError) -> ProcessingResponse:
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
