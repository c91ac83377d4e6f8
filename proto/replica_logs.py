"""shoal's log lines inside a Ray Serve replica.

Serve sets up only its own `ray.serve` logger in a replica: a file under the
session's logs/serve/ and, by default, stderr, which Ray forwards to the
console that started the cluster. A `shoal.*` logger has no handler there,
so its INFO lines (one per request, failovers, rebalancing) would go
nowhere. A replica's constructor calls use_serve_handlers(): shoal's
lines then land beside Serve's, tagged with the replica and request, at
the level the deployment's logging_config sets.
"""

from __future__ import annotations

import logging
import sys

SHOAL_LOGGER = "shoal"


def use_serve_handlers() -> bool:
    """Inside a Serve replica, send the `shoal` loggers to Serve's handlers
    and level; elsewhere (tests, `shoal generate`, benches) change nothing.
    Returns whether it did."""
    serve = sys.modules.get("ray.serve")  # a replica has Serve loaded already
    if serve is None:
        return False
    try:
        serve.get_replica_context()  # raises outside a replica (a driver may have Serve's logger set up too)
    except Exception:
        return False
    serve_logger = logging.getLogger("ray.serve")
    if not serve_logger.handlers:
        return False
    ours = logging.getLogger(SHOAL_LOGGER)
    ours.handlers = list(serve_logger.handlers)
    ours.setLevel(serve_logger.level)
    ours.propagate = False  # the root logger's handlers (if any) would print it twice
    return True
