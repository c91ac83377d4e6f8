"""Ray Serve request routers for the Worker deployment (`--routing`), set
through its RequestRouterConfig, so every handle to the workers routes the
same way. PolicyRequestRouter ranks the replicas with the policy named in
its request_router_kwargs (policies/) over this process's
replica_stats.REGISTRY and reserves the request at the first (optimistic
accounting) before Serve sends it; a policy that is Serve's own (pow2) gets
Serve's router.

Serve pickles this module by value into every process that routes: shared
state is reached through the `replica_stats` module, never imported by name.
`choose_replicas` never blocks (it runs on the caller's event loop) and sets
`should_backoff`, so that a pass where every replica is full sleeps before
the next; it returns one replica per rank, so Serve keeps this order (it
would otherwise take the shortest queue within a rank) and falls back down
the list past replicas at max_ongoing_requests.
"""

from __future__ import annotations

from typing import cast

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from shoal.proto.messages import GenerateRequest, Subscribe
from shoal.router.routing import policies, replica_stats

# Serve's poll of Worker.record_routing_stats: the figures when deltas do
# not flow (an idle worker), and the cached hashes. Serve's controller and
# long poll add ~100-200 ms to it; an unchanged report is not broadcast.
ROUTING_STATS_PERIOD_S = 0.2


def _arg(pending: PendingRequest | None):
    if pending is None:
        return None
    return pending.args[0] if pending.args else next(iter(pending.kwargs.values()), None)


def _request(pending: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest a `generate` call carries (None for info() etc.)."""
    req = _arg(pending)
    return req if isinstance(req, GenerateRequest) else None


def _target(candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]] | None:
    """A `subscribe` call goes to the one replica it names (none while that
    one is not among the candidates: the caller gives up after a while)."""
    sub = _arg(pending)
    if not isinstance(sub, Subscribe):
        return None
    cast(PendingRequest, pending).routing_context.should_backoff = True  # a Subscribe came in it
    return [[r] for r in candidates if r.replica_id.unique_id == sub.replica]


class PolicyRequestRouter(RequestRouter):
    """Every policy of ours (`kv` by default): the policy ranks, this reserves."""

    policy: policies.RoutingPolicy = policies.get_policy(policies.DEFAULT_POLICY)
    _turn = 0
    _figs_of: tuple = (None, None, None, [], [])  # (candidates, registry, its version, their names, figures)

    def _figures(self, candidates: list[RunningReplica], stats) -> tuple[list[str], list]:
        """The candidates' names and figures, looked up again only when Serve's
        list (rebuilt on every change, never edited) or the registry's set changes."""
        of, reg, version, names, figs = self._figs_of
        if of is not candidates or reg is not stats or version != stats.version:
            names = [r.replica_id.unique_id for r in candidates]
            figs = [stats.get(n) for n in names]
            self._figs_of = (candidates, stats, stats.version, names, figs)
        return names, figs

    def initialize_state(self, policy: str = policies.DEFAULT_POLICY, **kwargs) -> None:
        """Serve passes the RequestRouterConfig's request_router_kwargs here."""
        super().initialize_state(**kwargs)
        self.policy = policies.get_policy(policy)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (targeted := _target(candidate_replicas, pending_request)) is not None:
            return targeted
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        stats = replica_stats.REGISTRY
        names, figs = self._figures(candidate_replicas, stats)
        order = policies.route(stats, self.policy, _request(pending_request), names, figs, self._turn)
        self._turn += 1
        return [[candidate_replicas[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Serve took a replica further down the list (the first was full):
        move the reservation there."""
        request = _request(pending_request)
        if request is None:
            return
        stats, replica = replica_stats.REGISTRY, replica_id.unique_id
        if stats.where(request.request_id) != replica:
            blocks, tokens = policies.taken_at(self.policy, request, stats.get(replica), stats.block_size)
            hashes = request.block_hashes or ()
            stats.reserve(
                request.request_id,
                replica,
                blocks,
                hashes,
                tokens=tokens,
                group=request.parent_request_id,
                lora=request.lora_name,
            )

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


class Pow2Router(PowerOfTwoChoicesRequestRouter):
    """`pow2`: Serve's default (two replicas at random, the one with fewer
    requests queued), which also sends a `subscribe` call where it names."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (targeted := _target(candidate_replicas, pending_request)) is not None:
            return targeted
        return await super().choose_replicas(candidate_replicas, pending_request)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The figures the deltas brought (the status page's, the metrics')
        go with the replicas that left, as under the other policies."""
        super().update_replicas(replicas)
        replica_stats.REGISTRY.retain(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        replica_stats.REGISTRY.drop(replica_id.unique_id)


def router_class(policy: str) -> type[RequestRouter]:
    """The Serve request router class behind `--routing policy`."""
    return Pow2Router if policies.get_policy(policy).serve_builtin else PolicyRequestRouter


def request_router_config(policy: str) -> RequestRouterConfig:
    """The Worker deployment's RequestRouterConfig for `--routing policy`."""
    p = policies.get_policy(policy)
    if p.serve_builtin:  # Serve's own router takes no routing stats
        return RequestRouterConfig(request_router_class=Pow2Router)  # type: ignore[arg-type]  # ray types **kwargs as dicts
    # Serve polls the workers' routing stats every 0.2 s for a policy that reads them (else at its default).
    polled = {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S} if policies.reads_reports(p) else {}
    return RequestRouterConfig(
        request_router_class=PolicyRequestRouter,  # type: ignore[arg-type]  # (as above)
        request_router_kwargs={"policy": p.name},
        **polled,  # type: ignore[arg-type]
    )
