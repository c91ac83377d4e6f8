"""A router replica's settings, as the cluster's options hand them over."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from shoal.router.routing.policies.registry import DEFAULT_POLICY

# Where a router replica finds the API key: its own environment (a Kubernetes
# Secret, or what `shoal serve` hands the local Ray cluster it starts), never
# its init args, which Serve pickles into the cluster's state.
API_KEY_ENV = "SHOAL_API_KEY"


@dataclass(slots=True)
class RouterOptions:
    """What a router replica needs; the cluster's options fill every field."""

    model: str | None  # where the tokenizer comes from (the weights stay unread here)
    host: str
    http_port: int
    grpc_port: int
    num_workers: int
    max_request_bytes: int
    drain_timeout_s: float
    max_retries: int = 3  # re-sends of one request after its worker is lost (routing/failover.py)
    routing: str = DEFAULT_POLICY  # the workers' routing policy (routing/policies/), shown on the status page
    max_prompts: int = 64  # prompts in one completions request
    max_concurrent_requests: int = 1024  # sequences served at once (router/fronts/admission.py), and requests
    max_tokens_per_request: int | None = None  # prompt + max_tokens over a request's sequences; None: the context
    max_stream_buffer_tokens: int = 4096  # held for a client that does not read (routing/stream_buffer.py)
    tokenizer_threads: int = 2  # the pool that tokenizes off the event loop
    allow_client_priority: bool = False  # honour gRPC's priority field
    allowed_hosts: str | None = None  # comma-separated Host headers answered (None: the default rule)
    tool_call_parser: str | None = None  # reads tool_choice auto replies (router/fronts/tool_parsers); None: no auto
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    lora_root: str | None = None  # runtime loads only from inside it (the engine's --lora-root); None: anywhere
    max_runtime_loras: int | None = 8  # runtime loads served at once (the engine's --max-runtime-loras)
    metrics_include_lora_names: bool = False  # adapter names in shoal:lora_requests_info (else counts)
    # Connections (router/fronts/http_connections.py, grpc_connections.py) and TLS (tls.py)
    http_header_timeout_s: float = 10.0  # the request line and headers, from connect or the first byte
    http_body_timeout_s: float = 30.0  # the whole body, once the headers are in; then 408
    http_keep_alive_timeout_s: float = 5.0  # idle between requests
    max_connections: int | None = None  # per server; None: from the open-files limit
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None  # with ssl_keyfile: HTTPS and gRPC over TLS
    ssl_ca_certs: str | None = None  # checks client certificates
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED
    cache_isolation: str | None = None  # "none" or "key" (router/fronts/cache_isolation.py); None: key if a key is set
    # Only for a router built in this process (tests); one that Serve deploys reads $SHOAL_API_KEY.
    api_key: str | None = None

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "api_key")
        return f"RouterOptions({shown}, api_key={'<hidden>' if self.api_key else None})"

    def __getstate__(self):
        # Serve pickles a replica's init args into the cluster's state: a key must never ride there.
        if self.api_key is not None:
            raise TypeError("RouterOptions.api_key is not pickled; a router replica reads $SHOAL_API_KEY")
        return None, {f.name: getattr(self, f.name) for f in fields(self)}
