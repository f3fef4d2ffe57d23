"""`python -m gateway`: flags (from GatewayConfig's fields) -> GatewayConfig -> uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import resource
import sys

from gateway.config import GatewayConfig
from kvgate_cli.flags import add_flags, config_from_flags
from kvgate_cli.listen import listen_socket

# The configs whose fields are this command's flags (also the docs' flag table).
CONFIGS = (GatewayConfig,)
# Loggers of the client libraries, at --log-level-http.
HTTP_LOGGERS = ("httpx", "httpcore", "urllib3", "kubernetes.client.rest", "grpc", "hpack")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        usage="%(prog)s [flags]",
        description="kvgate routing gateway: OpenAI API in front of kvgate or vLLM workers",
    )
    add_flags(p, *CONFIGS)
    return p


def raise_open_files_limit() -> None:
    """Up to the hard limit: every worker takes a few sockets (a connection, a SUB, a replay
    DEALER), so a few hundred workers pass the soft limit some systems start with (1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return config_from_flags(GatewayConfig, args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if config.api_keys_file:  # fail at start, not on the first request
            from gateway.routing.tenants import TenantRegistry

            TenantRegistry(config.api_keys_file, config.tenant_salt_secret)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The client libraries log every poll (httpx at info, httpcore's wire events at debug):
    # their own level, so --log-level debug shows the gateway's decisions, not their traffic.
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(config.log_level_http.upper())
    raise_open_files_limit()
    try:
        sockets = [listen_socket(config.host, config.port)]
        if config.admin_port is not None:  # same server, same app: gateway/http/admin.py
            sockets.append(listen_socket(config.host, config.admin_port, "--admin-port"))
    except OSError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from gateway.app import create_app
    from gateway.http.drain import draining_server

    app = create_app(config)
    uvicorn_config = uvicorn.Config(app, log_level=config.log_level, access_log=False)
    draining_server(uvicorn_config, app, config.drain_timeout).run(sockets=sockets)
    return 0
