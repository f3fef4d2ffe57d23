"""Routing policies behind one signature (plain: ranking never waits); `POLICIES` maps a name
to its class."""

from gateway.routing.policies.base import Policy, RouteContext
from gateway.routing.policies.cache_aware import CacheAwarePolicy
from gateway.routing.policies.least_loaded import LeastLoadedPolicy
from gateway.routing.policies.random import RandomPolicy
from gateway.routing.policies.round_robin import RoundRobinPolicy
from gateway.routing.policies.session import SessionPolicy

POLICIES: dict[str, type] = {
    "cache_aware": CacheAwarePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "session": SessionPolicy,
    "random": RandomPolicy,
}

__all__ = ["POLICIES", "Policy", "RouteContext"]
