"""HTTP routes: the proxied POST routes (`PROXIED`, served by `serve_proxied`) and thin wrappers
over the state for the rest.

`GatewayApp` (gateway/app.py) serves the proxied routes itself, before FastAPI's middleware and
routing; `attach_routes` registers the same table so that the OpenAPI schema lists them, through
the same `serve_proxied`: one path either way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from cachekey.openai.errors import APIError
from gateway.errors import error_response, http_error_response
from gateway.http.serving import ProxyServing
from gateway.serving.read import authenticate
from gateway.state import GatewayState


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _no_worker(st: GatewayState) -> Response:
    """503 naming every worker and why it takes no traffic."""
    msg = "no healthy worker: " + st.replicas.describe()
    return error_response(APIError(503, msg, code="no_healthy_worker"))


# The routes proxied to a worker, and the ProxyServing method that serves each.
PROXIED: dict[str, Callable[[ProxyServing, Request], Awaitable[Response]]] = {
    "/v1/chat/completions": ProxyServing.chat_completions,
    "/v1/completions": ProxyServing.completions,
    "/v1/embeddings": ProxyServing.embeddings,
}


async def serve_proxied(state: GatewayState, request: Request) -> Response:
    """A proxied route's answer (its path is in PROXIED), whichever way the request came in."""
    return await PROXIED[request.scope["path"]](ProxyServing(state), request)


async def _proxied_route(request: Request) -> Response:
    return await serve_proxied(_state(request), request)


def attach_routes(app: FastAPI) -> None:
    app.add_exception_handler(HTTPException, http_error_response)
    for path, serve in PROXIED.items():
        app.add_api_route(path, _proxied_route, methods=["POST"], name=serve.__name__)
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/kvgate/index", index_debug, methods=["GET"])


async def models(request: Request) -> Response:
    st = _state(request)
    try:
        authenticate(st, request)
    except Exception as e:
        return error_response(e)
    reps = st.replicas.available()
    if not reps:
        return _no_worker(st)
    urls = dict.fromkeys(r.url for r in reps)  # one request per worker, not per rank
    results = await asyncio.gather(
        *(st.http.get(f"{u}/v1/models", timeout=st.config.connect_timeout) for u in urls),
        return_exceptions=True,
    )
    seen: dict[str, dict] = {}
    for res in results:
        if isinstance(res, Exception) or res.status_code != 200:
            continue
        for m in res.json().get("data", []):
            seen.setdefault(m.get("id"), _public_card(m))
    return JSONResponse({"object": "list", "data": list(seen.values())})


def _public_card(card: dict) -> dict:
    """A worker's model card as clients see it: `root` (vLLM's and the worker's: the model's or
    adapter's path on the worker's filesystem) becomes the model's name."""
    if "root" in card:
        return {**card, "root": card.get("id")}
    return card


async def health(request: Request) -> Response:
    """Whether a request would be routed now: 503 with the reason while no worker is."""
    st = _state(request)
    n = len(st.replicas.available())
    if n == 0:
        return _no_worker(st)
    return JSONResponse({"status": "ok", "healthy_replicas": n})


async def ready(request: Request) -> Response:
    """Whether this gateway can answer (the chart's readiness probe): yes once it knows its
    workers' state (discovery answered, each worker polled once), workers up or not, so that
    with every worker down clients still reach the gateway and get its 503 naming why, instead
    of a Service with no endpoints. A draining gateway has closed its listener, so this fails
    then (kvgate_cli/drain.py)."""
    st = _state(request)
    if not st.replicas.known:
        msg = "starting: discovering and polling the workers"
        return error_response(APIError(503, msg, code="starting"))
    return JSONResponse({"status": "ready", "healthy_replicas": len(st.replicas.available())})


async def metrics(request: Request) -> Response:
    st = _state(request)
    s = st.index.stats()
    st.metrics.index_blocks.set(s.blocks)
    st.metrics.index_bytes.set(s.bytes)
    return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")


async def index_debug(request: Request) -> Response:
    """Per replica: blocks (GPU, and its host tier's), seq, instance id and a digest of its
    GPU's key set."""
    st = _state(request)
    s = st.index.stats()
    replicas = {}
    for r in st.replicas:
        sub = r.link.subscriber
        replicas[r.id] = {
            "name": r.name,  # the x-kvgate-replica clients see
            "instance_id": r.instance_id,
            "healthy": r.healthy,
            "parity_ok": r.parity_ok,
            "blocks": st.index.lookup.replica_blocks(r.id),
            "host_blocks": st.index.lookup.replica_blocks(r.id, host=True),
            "seq": sub.last_seq if sub is not None else None,
            "synced": sub.synced.is_set() if sub is not None else False,
            "digest": st.index.lookup.replica_digest(r.id),
        }
    return JSONResponse(
        {
            "blocks": s.blocks,
            "copies": s.copies,
            "bytes": s.bytes,
            "skipped_unknown_parent": s.skipped_unknown_parent,
            "replicas": replicas,
        }
    )
