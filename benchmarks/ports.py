"""A free localhost port, for the clusters and servers that benchmarks and
tests start on ports of their own (the OS picks one; nothing holds it after)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
