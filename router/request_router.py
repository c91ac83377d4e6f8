"""Ray Serve request routers for the Worker deployment (`--routing`), set
through its RequestRouterConfig, so every handle to the workers routes the
same way. Each ranks the replicas with routing.py over this process's
replica_stats.REGISTRY and reserves the request at the first (optimistic
accounting) before Serve sends it.

Serve pickles this module by value into every process that routes: shared
state is reached through the `replica_stats` module, never imported by name.
`choose_replicas` never blocks (it runs on the caller's event loop) and sets
`should_backoff`, so that a pass where every replica is full sleeps before
the next; it returns one replica per rank, so Serve keeps this order (it
would otherwise take the shortest queue within a rank) and falls back down
the list past replicas at max_ongoing_requests.
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from shoal.router import replica_stats, routing
from shoal.workers.messages import GenerateRequest

# Serve's default: two replicas at random, the one with fewer requests.
POW2 = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
# Serve's poll of Worker.record_routing_stats: the figures when deltas do
# not flow (an idle worker), and the cached hashes. Serve's controller and
# long poll add ~100-200 ms to it; an unchanged report is not broadcast.
ROUTING_STATS_PERIOD_S = 0.2


def _request(pending: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest a `generate` call carries (None for info() etc.)."""
    if pending is None:
        return None
    req = pending.args[0] if pending.args else pending.kwargs.get("request")
    return req if isinstance(req, GenerateRequest) else None


class KVRequestRouter(RequestRouter):
    """`kv`: free KV blocks after the request, prefix affinity, queue depth."""

    policy = "kv"
    _turn = 0
    _figs_of: tuple = (None, None, None, [])  # (candidates, registry, its version, their figures)

    def _figures(self, candidates: list[RunningReplica], stats) -> list:
        """The candidates' figures, looked up again only when Serve's list
        (rebuilt on every change, never edited) or the registry's set changes."""
        of, reg, version, figs = self._figs_of
        if of is not candidates or reg is not stats or version != stats.version:
            figs = [stats.get(r.replica_id.unique_id) for r in candidates]
            self._figs_of = (candidates, stats, stats.version, figs)
        return figs

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:  # fmt: skip
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        stats = replica_stats.REGISTRY
        figs = self._figures(candidate_replicas, stats)
        request = _request(pending_request)
        order, blocks = routing.choose(self.policy, request, figs, self._turn)
        self._turn += 1
        if request is not None:
            stats.reserve(request.request_id, candidate_replicas[order[0]].replica_id.unique_id, blocks,
                          request.block_hashes or ())  # fmt: skip
        return [[candidate_replicas[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Serve took a replica further down the list (the first was full):
        move the reservation there."""
        request = _request(pending_request)
        if request is None:
            return
        stats, replica = replica_stats.REGISTRY, replica_id.unique_id
        if stats.where(request.request_id) != replica:
            f = stats.get(replica)
            blocks = routing.blocks_at(request, f) if self.policy == "kv" else 0
            stats.reserve(request.request_id, replica, blocks, request.block_hashes or ())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The replica set or a replica's routing stats changed (Serve's long poll)."""
        super().update_replicas(replicas)
        stats = replica_stats.REGISTRY
        for r in replicas:
            if r.routing_stats:
                stats.observe_poll(r.replica_id.unique_id, r.routing_stats)
        stats.retain(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        replica_stats.REGISTRY.drop(replica_id.unique_id)


class LeastRequestsRouter(KVRequestRouter):
    """`least-requests`: the fewest requests in flight, counting what this
    process sent since each replica's report."""

    policy = "least-requests"


class RoundRobinRouter(KVRequestRouter):
    """`round-robin`: each replica in turn."""

    policy = "round-robin"


ROUTERS = {"kv": KVRequestRouter, "least-requests": LeastRequestsRouter, "pow2": POW2,
           "round-robin": RoundRobinRouter}  # fmt: skip


def request_router_config(policy: str) -> RequestRouterConfig:
    """The Worker deployment's RequestRouterConfig for `--routing policy`."""
    cls = ROUTERS[policy]
    if cls == POW2:
        return RequestRouterConfig(request_router_class=POW2)
    return RequestRouterConfig(request_router_class=cls, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
