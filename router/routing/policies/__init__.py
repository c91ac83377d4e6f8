"""How the router ranks worker replicas: one object per `--routing` policy
(base.RoutingPolicy), each in its own module and listed once in
registry.py, ranking over ReplicaFigures (replica_stats.py) the same for
Ray Serve's request router (request_router.py) and the in-process pool
(worker_pool.py), through one routing step (route.py).

- `kv` (kv.py): the estimated time to the first token: free KV blocks,
  prefix-cache affinity, queue depth, and where the request's adapter is.
- `least-requests` (least_requests.py): the fewest requests in flight.
- `pow2` (pow2.py): Serve's power of two choices; in the cluster Serve's own
  router. Blind to adapters.
- `round-robin` (round_robin.py): each replica in turn.

A replica that does not serve the request's LoRA adapter comes last under
every policy but `pow2` (lora.py). A policy declares what it reads
(needs_load, needs_prefix, needs_adapters) and its callers provide that.
"""

from shoal.router.routing.policies.base import DOES_NOT_FIT, Ranking, RoutingPolicy, reads_reports
from shoal.router.routing.policies.kv import kv_rank
from shoal.router.routing.policies.least_requests import least_requests_rank, queue_depth
from shoal.router.routing.policies.lora import LORA_DISK_TOKENS, LORA_HELD_TOKENS, LORA_HOST_TOKENS, lora_cost
from shoal.router.routing.policies.need import RequestNeed, blocks_at, need_of, prefix_hit, request_need
from shoal.router.routing.policies.registry import DEFAULT_POLICY, POLICIES, POLICY_NAMES, get_policy, routing_help
from shoal.router.routing.policies.round_robin import round_robin_rank
from shoal.router.routing.policies.route import route, taken_at

__all__ = [
    "DEFAULT_POLICY",
    "DOES_NOT_FIT",
    "LORA_DISK_TOKENS",
    "LORA_HELD_TOKENS",
    "LORA_HOST_TOKENS",
    "POLICIES",
    "POLICY_NAMES",
    "Ranking",
    "RequestNeed",
    "RoutingPolicy",
    "blocks_at",
    "get_policy",
    "kv_rank",
    "least_requests_rank",
    "lora_cost",
    "need_of",
    "prefix_hit",
    "queue_depth",
    "reads_reports",
    "request_need",
    "round_robin_rank",
    "route",
    "routing_help",
    "taken_at",
]
