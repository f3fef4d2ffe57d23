"""`python -m worker`: flags (from EngineConfig's and ServerConfig's fields) -> engine -> API."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cachekey.documents import WorkerInfo
from kvgate_cli.flags import add_flags, config_from_flags, given
from kvgate_cli.listen import listen_socket
from worker.engine.config import EngineConfig
from worker.server.config import ServerConfig

logger = logging.getLogger("worker")

# The configs whose fields are this command's flags (also the docs' flag table).
CONFIGS = (EngineConfig, ServerConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m worker",
        usage="%(prog)s --model PATH|demo [flags]",
        description="kvgate inference worker: one model behind an OpenAI-compatible API",
    )
    add_flags(p, *CONFIGS)
    return p


def resolve_model(model: str) -> str:
    if model == "demo":
        from worker.demo.model import ensure_demo_model

        return str(ensure_demo_model())
    return model


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    server_config = config_from_flags(ServerConfig, args)
    overrides = {"model": resolve_model(args.model)}
    if args.model == "demo" and not given(args, "served_model_name"):
        overrides["served_model_name"] = "demo"
    return config_from_flags(EngineConfig, args, **overrides), server_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if server_config.worker_token is None:
        logger.warning(
            "no worker token (--worker-token or KVGATE_WORKER_TOKEN): every endpoint and the "
            "KV events are open to whoever reaches this worker (docs/security.md)"
        )

    from worker.server.launch import spawn_worker_cores

    try:
        sock = listen_socket(server_config.host, server_config.port)
        # One engine core process per data-parallel rank, each with its own KV cache (as
        # vLLM's); the model loads there while this process imports its web stack.
        starting = spawn_worker_cores(engine_config, server_config)
    except (ValueError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from kvgate_cli.drain import DrainingServer
        from worker.server.app import create_app
    except BaseException:
        starting.abandon()
        raise
    try:
        cores = starting.wait()
    except (ValueError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        try:
            ready = _ready_line(engine_config, server_config)
            app = create_app(cores, server_config, on_ready=ready)
        except (ValueError, OSError) as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 2
        # SIGTERM drains (kvgate_cli/drain.py): streams in flight get --drain-timeout to finish;
        # then the lifespan stops the engine cores.
        uvicorn_config = uvicorn.Config(app, log_level=server_config.log_level, access_log=False)
        server = DrainingServer(
            uvicorn_config, streams=app.state.streams, drain_timeout=server_config.drain_timeout
        )
        server.run(sockets=[sock])
    finally:
        cores.stop()
    return 0


def _ready_line(engine_config: EngineConfig, server_config: ServerConfig):
    def ready(info: WorkerInfo) -> None:
        events = (
            f"tcp://{server_config.host}:{server_config.kv_events_port}"
            if server_config.events_enabled
            else "disabled"
        )
        ranks = len(info.data_parallel_ranks)
        print(
            f"kvgate worker ready: http://{server_config.host}:{server_config.port} "
            f"model={info.model} engine={engine_config.engine} "
            f"instance={info.instance_id} kv-events={events}"
            + (f" (+ rank index, {ranks} data-parallel ranks)" if ranks else ""),
            flush=True,
        )

    return ready
