"""The routing policies, listed once: `--routing`'s choices and help, the
Serve config's check, the request routers and the in-process pool all read
this. Each module of this package that holds a `POLICY` is one, found here
by its module's name, so a new policy is a module beside this one and its
test, nothing else. The Helm chart takes any name and the router refuses
one it does not know at start."""

from __future__ import annotations

import importlib
import os
import pkgutil

from shoal.router.routing.policies.base import RoutingPolicy

_PACKAGE = __name__.rpartition(".")[0]


def _discover(path: list[str] | None = None) -> dict[str, RoutingPolicy]:
    """Every POLICY of the modules in `path` (this package's folder), by name."""
    found: dict[str, RoutingPolicy] = {}
    path = path or [os.path.dirname(__file__)]
    for mod in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        policy = getattr(importlib.import_module(f"{_PACKAGE}.{mod.name}"), "POLICY", None)
        if policy is None:
            continue
        if policy.name in found:
            raise RuntimeError(f"two routing policies named {policy.name!r}")
        found[policy.name] = policy
    return found


POLICIES: dict[str, RoutingPolicy] = _discover()
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
