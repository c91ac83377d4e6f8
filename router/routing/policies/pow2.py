"""`pow2`: Serve's default router, power of two choices: two replicas at
random, the one with fewer requests queued first. In the cluster Serve's own
router ranks (request_router.Pow2Router, probing the replicas' queues
itself); choose() is the same rule over this process's figures, for the
in-process pool. Blind to prefixes and to adapters altogether: a replica
that lacks a runtime-loaded adapter answers 404."""

from __future__ import annotations

import random
from collections.abc import Sequence

from shoal.router.routing.policies.base import Ranking
from shoal.router.routing.policies.least_requests import least_requests_rank, queue_depth
from shoal.router.routing.replica_stats import ReplicaFigures


class Pow2Policy:
    name = "pow2"
    summary = "Serve's power of two choices"
    needs_load = True
    needs_prefix = False
    needs_adapters = False
    serve_builtin = True

    def choose(self, request, figs: Sequence[ReplicaFigures], block_size: int, turn: int = 0) -> Ranking:
        if len(figs) < 2:
            return Ranking(list(range(len(figs))))
        a, b = random.sample(range(len(figs)), 2)
        if queue_depth(figs[b]) < queue_depth(figs[a]):
            a, b = b, a
        # The rest as fallbacks (Serve's router would draw two more), least loaded first.
        return Ranking([a, b, *(i for i in least_requests_rank(figs) if i != a and i != b)])


POLICY = Pow2Policy()  # found by registry.py
