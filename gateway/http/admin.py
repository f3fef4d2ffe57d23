"""Admin endpoints on their own port (`--admin-port`): `/metrics` and `/kvgate/index`.

Both tell whoever reads them about other tenants' traffic (per-request token deltas, every
replica's index) and the workers' URLs. With an admin port they are answered only there, and
the public port answers them 404, so an Ingress or LoadBalancer in front of the public port
never exposes them; the admin port answers nothing else but `/health` and `/ready`. One server
serves both sockets (one app, one state): the port a connection arrived on says which side it
is.
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Scope

from cachekey.openai.errors import UNKNOWN_URL, APIError
from gateway.errors import error_response

ADMIN_PATHS = frozenset({"/metrics", "/kvgate/index"})
_ADMIN_PORT_PATHS = ADMIN_PATHS | {"/health", "/ready"}


def misrouted(scope: Scope, admin_port: int) -> bool:
    """Whether a request asks the wrong port for its path."""
    server = scope.get("server")
    on_admin = server is not None and server[1] == admin_port
    path = scope["path"]
    return path not in _ADMIN_PORT_PATHS if on_admin else path in ADMIN_PATHS


def not_found(scope: Scope) -> Response:
    where = "the admin port" if scope["path"] in ADMIN_PATHS else "the public port"
    message = f"Not Found: {scope['path']} is served on {where}"
    return error_response(APIError(404, message, code=UNKNOWN_URL))
