"""Which policy ranks a request: the one its `x-kvgate-routing-policy` header names, else
`--policy`."""

from __future__ import annotations

from collections.abc import Mapping

from cachekey.headers import POLICY_HEADER
from cachekey.openai.errors import INVALID_VALUE, APIError
from gateway.routing.policies import Policy
from gateway.routing.services import RouteServices


def choose_policy(state: RouteServices, headers: Mapping[str, str]) -> tuple[str, Policy]:
    """The policy's name and the policy (400 for a name that is no policy)."""
    name = headers.get(POLICY_HEADER) or state.config.policy
    policy = state.policies.get(name)
    if policy is None:
        raise APIError(
            400,
            f"unknown routing policy {name[:64]!r} in {POLICY_HEADER}; "
            f"valid: {', '.join(state.policies)}",
            param=POLICY_HEADER,
            code=INVALID_VALUE,
        )
    return name, policy


def policy_label(state: RouteServices, headers: Mapping[str, str]) -> str:
    """The `policy` label of a request refused before routing: the one it asked for, if that
    is a policy (an unknown name must not become a label), else the default."""
    name = headers.get(POLICY_HEADER)
    return name if name in state.policies else state.config.policy
