"""create_app: the worker's FastAPI app around its started engine cores (launch.py).

`init_app_state` builds everything the routes use, once; the routers reach it through
`request.app.state`. The lifespan starts reading each core's reports and stops the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from cachekey.bodies import budget_bytes
from cachekey.documents import WorkerInfo
from worker.server.app_state import WorkerState, init_app_state
from worker.server.auth import WorkerAuth
from worker.server.body_guard import BodyGuard
from worker.server.config import ServerConfig
from worker.server.engine_client import AsyncEngine
from worker.server.errors import install_error_handlers
from worker.server.launch import Cores
from worker.server.prefix_hint import PrefixHint
from worker.server.routers import debug, embeddings, kvgate, lora, openai, ops, peers

_WATCHDOG_S = 0.5


def create_app(
    cores: Cores,
    config: ServerConfig,
    *,
    on_ready: Callable[[WorkerInfo], None] | None = None,
) -> FastAPI:
    """The app around one engine core, or one per data-parallel rank (`--data-parallel-size`);
    it stops them when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(cores.stop)
            for rank in app.state.ranks:
                await stack.enter_async_context(_running(rank))
            if on_ready is not None:
                on_ready(state.info)
            yield

    app = FastAPI(title="kvgate worker", lifespan=lifespan)
    state = init_app_state(app.state, cores.handles, config, cores.identity)
    install_error_handlers(app)
    for module in (openai, embeddings, ops, kvgate, peers):
        app.include_router(module.router)
    if config.allow_runtime_lora_updating:
        app.include_router(lora.router)
    if config.enable_fault_injection:
        app.include_router(debug.router)
    # Added last is outermost: the token is checked before the prefix hint is acted on, and
    # both before a body is read.
    app.add_middleware(
        BodyGuard,
        max_bytes=config.max_body_bytes,
        max_depth=config.max_json_depth,
        max_elements=config.max_json_elements,
        read_timeout=config.body_read_timeout,
        budget=budget_bytes(config.body_read_budget, config.max_body_bytes),
    )
    app.add_middleware(PrefixHint)
    if config.worker_token is not None:
        app.add_middleware(WorkerAuth, token=config.worker_token, open_paths=config.open_paths)
    return app


@contextlib.asynccontextmanager
async def _running(state: WorkerState) -> AsyncIterator[None]:
    state.engine.start(asyncio.get_running_loop())
    watchdog = asyncio.create_task(_watchdog(state.engine))
    try:
        yield
    finally:
        watchdog.cancel()
        state.engine.shutdown()


async def _watchdog(engine: AsyncEngine) -> None:
    # Requests already waiting on a stalled core would hang forever: fail them. (A core that
    # exits or says it died fails them at once, engine_client.py.)
    while True:
        await asyncio.sleep(_WATCHDOG_S)
        health = engine.health()
        if not health.ok:
            engine.fail_all_pending(health.reason or "engine unavailable")
