"""The one routing step of both pools (Serve's request router and the
in-process pool): choose, reserve at the first, trace."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.router.routing.policies.base import RoutingPolicy
from shoal.router.routing.policies.need import blocks_at
from shoal.router.routing.replica_stats import ReplicaFigures, ReplicaStats


def taken_at(policy: RoutingPolicy, request, f: ReplicaFigures, block_size: int) -> tuple[int, int]:
    """What to reserve for `request` at replica f when it goes there rather
    than where `policy` ranked first: its KV blocks and prompt tokens to
    prefill there, counted only for a policy that reads them."""
    if policy.needs_prefix and block_size:
        return blocks_at(request, f, block_size)
    return 0, 0


def route(
    stats: ReplicaStats,
    policy: RoutingPolicy,
    request,
    names: Sequence[str],
    figs: Sequence[ReplicaFigures],
    turn: int = 0,
) -> list[int]:
    """The replicas' order for `request` (None for a call that is no
    request) over `figs` (those of `names`, from `stats`); the request counts
    as sent to the first. Parallel-sampling siblings (one parent_request_id)
    all go where the first of them went, whatever the policy: there the
    prompt is prefilled once for all of them."""
    order, blocks, tokens = policy.choose(request, figs, stats.block_size, turn)
    group = None if request is None else request.parent_request_id
    if group is not None and order and (at := stats.group_replica(group)) in names:
        pinned = names.index(at)
        if pinned != order[0]:
            order = [pinned, *(i for i in order if i != pinned)]
            blocks, tokens = taken_at(policy, request, figs[pinned], stats.block_size)
    if request is not None and order:
        stats.reserve(
            request.request_id,
            names[order[0]],
            blocks,
            request.block_hashes or (),
            tokens=tokens,
            group=group,
            lora=request.lora_name,
        )
        if request.trace_context:  # the request's routing span: what each candidate looked like
            # Imported here: the flags read the registry beside this module, and `shoal bench gpu`
            # runs where opentelemetry is absent (the GPU machine).
            from shoal.router.observability import tracing

            tracing.trace_route(request.trace_context, list(names), figs, order[0], policy.name)
    return order
