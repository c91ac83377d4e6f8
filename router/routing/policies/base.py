"""What a routing policy is: an object that ranks the replicas for one
request (`choose`), and declares what it reads, so that its callers (the
routing step, route.py; Serve's request router; the in-process pool)
compute and poll only that."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from shoal.router.routing.replica_stats import ReplicaFigures

# Added to a cost where the request does not fit or the replica does not
# serve its adapter: past any cost a replica that can take it has.
DOES_NOT_FIT = 1e12


class Ranking(NamedTuple):
    """The replicas' order for a request, best first (indexes into the
    figures), and what it takes at the first: KV blocks and prompt tokens
    to prefill (0 and 0 for a policy that does not read the prefix chain)."""

    order: list[int]
    blocks: int = 0
    tokens: int = 0


class RoutingPolicy(Protocol):
    """One `--routing` value."""

    name: str  # the flag's value
    summary: str  # a few words for --routing's help
    # What choose() reads, which its callers provide:
    needs_load: bool  # the replicas' queues (their figures kept fresh: deltas, routing-stats poll)
    needs_prefix: bool  # the request's chain hashes against the blocks each replica holds (and the block size):
    #                     a caller that reserves at another replica computes what it takes there (route.py)
    needs_adapters: bool  # where each replica holds LoRA adapters (the poll's WorkerLoad.loras)
    # In the cluster, Serve's own request router ranks instead of choose() (which serves the in-process pool).
    serve_builtin: bool

    def choose(self, request, figs: Sequence[ReplicaFigures], block_size: int, turn: int = 0) -> Ranking:
        """The ranking for `request` (a GenerateRequest, or None for a call that
        is no request) over the replicas' figures; `block_size` is the model's
        (0 before a WorkerInfo was read here), `turn` counts the caller's calls."""
        ...


def reads_reports(policy: RoutingPolicy) -> bool:
    """Whether `policy` reads anything the replicas report: their routing stats are polled for it."""
    return policy.needs_load or policy.needs_prefix or policy.needs_adapters
