"""`least-requests`: the fewest requests in flight at each replica, counting
what this process sent since its report; blind to prefixes, and to adapters
but for moving the replicas that do not serve the request's last."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.router.routing.policies.base import Ranking
from shoal.router.routing.policies.lora import adapter_servers_first
from shoal.router.routing.replica_stats import ReplicaFigures


def queue_depth(f: ReplicaFigures) -> int:
    """Requests at a replica: what it reported and what this process sent
    since, or this process's own count in flight there if that is more (a
    report older than this process's latest sends)."""
    return max(f.in_flight, f.running + f.waiting + len(f.sent))


def least_requests_rank(figs: Sequence[ReplicaFigures]) -> list[int]:
    """The replicas by queue depth, ties to the lower index."""
    return sorted(range(len(figs)), key=lambda i: (queue_depth(figs[i]), i))


class LeastRequestsPolicy:
    name = "least-requests"
    summary = "the fewest requests in flight"
    needs_load = True
    needs_prefix = False
    needs_adapters = True
    serve_builtin = False

    def choose(self, request, figs: Sequence[ReplicaFigures], block_size: int, turn: int = 0) -> Ranking:
        return Ranking(adapter_servers_first(least_requests_rank(figs), figs, request))


POLICY = LeastRequestsPolicy()  # found by registry.py
