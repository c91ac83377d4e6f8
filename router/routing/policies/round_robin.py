"""`round-robin`: each replica in turn, blind to load and prefixes, and to
adapters but for moving the replicas that do not serve the request's last."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.router.routing.policies.base import Ranking
from shoal.router.routing.policies.lora import adapter_servers_first
from shoal.router.routing.replica_stats import ReplicaFigures


def round_robin_rank(n: int, turn: int) -> list[int]:
    """Replica `turn % n` first, then the ones after it (fallbacks)."""
    start = turn % n if n else 0
    return [*range(start, n), *range(start)]


class RoundRobinPolicy:
    name = "round-robin"
    summary = "each worker in turn"
    needs_load = False
    needs_prefix = False
    needs_adapters = True
    serve_builtin = False

    def choose(self, request, figs: Sequence[ReplicaFigures], block_size: int, turn: int = 0) -> Ranking:
        return Ranking(adapter_servers_first(round_robin_rank(len(figs), turn), figs, request))


POLICY = RoundRobinPolicy()  # found by registry.py
