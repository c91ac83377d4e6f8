"""The routing policies, listed once: `--routing`'s choices and help, the
Serve config's check, the request routers and the in-process pool all read
this (the Helm chart's values.schema.json enum is held equal to it by
tests/test_routing_policies.py). A new policy is a module beside this one,
one line here, and its test."""

from __future__ import annotations

from shoal.router.routing.policies.base import RoutingPolicy
from shoal.router.routing.policies.kv import KVPolicy
from shoal.router.routing.policies.least_requests import LeastRequestsPolicy
from shoal.router.routing.policies.pow2 import Pow2Policy
from shoal.router.routing.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, RoutingPolicy] = {
    p.name: p for p in (KVPolicy(), LeastRequestsPolicy(), Pow2Policy(), RoundRobinPolicy())
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT_POLICY = "kv"


def get_policy(name: str) -> RoutingPolicy:
    """The policy named `name`; a ValueError naming the known ones for any other."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None


def routing_help() -> str:
    """--routing's help: each policy's name and summary."""
    return "how the router picks a worker: " + "; ".join(f"{p.name} = {p.summary}" for p in POLICIES.values())
