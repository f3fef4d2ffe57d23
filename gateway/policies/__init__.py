"""Routing policies behind one async signature; `POLICIES` maps a name to its class."""

from gateway.policies.base import Policy, RouteContext
from gateway.policies.cache_aware import CacheAwarePolicy
from gateway.policies.least_loaded import LeastLoadedPolicy
from gateway.policies.random import RandomPolicy
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.policies.session import SessionPolicy

POLICIES: dict[str, type] = {
    "cache_aware": CacheAwarePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "session": SessionPolicy,
    "random": RandomPolicy,
}

__all__ = ["POLICIES", "Policy", "RouteContext"]
