"""The gRPC server's connection bounds (grpc core channel arguments), the
counterpart of http_connections.py: how many connections it holds, how long
a new one may take to handshake, and when idle or dead ones go."""

from __future__ import annotations

# An idle connection (no call in flight) is closed with GOAWAY after this; a
# client reconnects on its next call without noticing.
MAX_IDLE_MS = 5 * 60_000
# A connection is told to go after this (the calls on it finish first: the grace
# is unbounded), so clients spread again over the host's routers (SO_REUSEPORT).
MAX_AGE_MS = 30 * 60_000
# The server pings a connection quiet for this long and drops it without an
# answer in KEEPALIVE_TIMEOUT_MS: a peer gone without a FIN frees its descriptor.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


def connection_options(max_connections: int | None, handshake_timeout_s: float | None) -> list[tuple[str, int]]:
    """Server options; None leaves grpc's default (no cap; a 120 s handshake)."""
    opts = [
        ("grpc.max_connection_idle_ms", MAX_IDLE_MS),
        ("grpc.max_connection_age_ms", MAX_AGE_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]
    if max_connections is not None:  # past it grpc closes a new connection at once
        opts.append(("grpc.max_allowed_incoming_connections", max_connections))
    if handshake_timeout_s is not None:  # TLS and the HTTP/2 preface, like the HTTP port's header deadline
        opts.append(("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout_s * 1000))))
    return opts
