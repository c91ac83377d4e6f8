"""A router replica's settings, as the cluster's options hand them over."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RouterOptions:
    """What a router replica needs; the cluster's options fill every field."""

    model: str | None  # where the tokenizer comes from (the weights stay unread here)
    host: str
    http_port: int
    grpc_port: int
    num_workers: int
    api_key: str | None
    max_request_bytes: int
    drain_timeout_s: float
    max_retries: int = 3  # re-sends of one request after its worker is lost (router/failover.py)
    routing: str = "kv"  # the workers' routing policy, shown on the status page
    max_prompts: int = 64  # prompts in one completions request
    max_concurrent_requests: int = 1024  # HTTP connections and gRPC calls served at once
    tokenizer_threads: int = 2  # the pool that tokenizes off the event loop
    allow_client_priority: bool = False  # honour gRPC's priority field
    allowed_hosts: str | None = None  # comma-separated Host headers answered (None: the default rule)
