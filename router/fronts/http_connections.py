"""What uvicorn leaves unbounded on a connection, bounded: the time a client
takes to send a request's line and headers (uvicorn times only the idle wait
between requests, and a connection that has sent nothing, or half a request
line, is held for ever), and the number of connections open at once (each is
a file descriptor; past the process's limit the server accepts nothing).

The request body has its own deadline in the app (OpenAIApp._read_json: 408)."""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's "auto" choice: httptools when it is installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    _Fastest: type = HttpToolsProtocol
except ImportError:  # pragma: no cover
    _Fastest = H11Protocol

if TYPE_CHECKING:  # what the mixin reads of the protocol it is mixed into
    _Protocol = H11Protocol
else:
    _Protocol = object

logger = logging.getLogger(__name__)

# Past the cap a new connection gets this and is closed; those already open go on.
_FULL_BODY = b'{"error":{"message":"this router has as many connections open as it serves (--max-connections)",'
_FULL_BODY += b'"type":"service_unavailable_error","param":null,"code":"too_many_connections"}}'
FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY
)
# File descriptors kept for what else a router process opens: Ray's own sockets to
# the raylet, the GCS and the workers, log files, the tokenizer's files.
MIN_FD_HEADROOM = 256


@dataclass(slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # from connect (or the first byte after an idle wait) to the headers' end
    keep_alive_timeout_s: float = 5.0  # idle between requests (uvicorn's timeout_keep_alive)
    max_connections: int | None = None  # open at once; None: connection_cap(None)


def file_limit() -> int:
    """The process's soft limit on open files (RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def raise_file_limit(target: int = 65536) -> int:
    """Raise the soft open-files limit towards the hard one, as vLLM's API
    server does (containers often start at 1024); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, want, e)
    return file_limit()


def connection_cap(requested: int | None, nofile: int | None = None) -> int:
    """Connections one server (HTTP, or gRPC) may hold open: the request, or
    by default half of what the file limit leaves after a headroom, so that both
    servers at their caps still leave the process descriptors; never above that."""
    nofile = file_limit() if nofile is None else nofile
    most = max(1, (nofile - max(MIN_FD_HEADROOM, nofile // 8)) // 2)
    if requested is None:
        return most
    if requested > most:
        logger.warning(
            "--max-connections %d is more than the open-files limit (%d) allows with HTTP and gRPC both full; using %d",
            requested,
            nofile,
            most,
        )
        return most
    return requested


class _Bounded(_Protocol):
    """Mixed in before one of uvicorn's HTTP/1.1 protocols; protocol_class()
    sets the two class attributes."""

    header_timeout_s: float
    max_connections: int
    _header_timer: asyncio.TimerHandle | None = None  # the pending close, while a request's headers are awaited

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one included
            logger.debug("connection from %s refused: %d open", self.client, len(self.connections) - 1)
            transport.write(FULL)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._awaiting_request():
            self._arm()  # the first byte of a request after an idle keep-alive wait
        super().data_received(data)
        if not self._awaiting_request():  # the headers are in: the request is the app's now
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_request(self) -> bool:
        # Both protocols make the request's cycle once its headers are complete.
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_request() and not self.transport.is_closing():
            logger.debug(
                "closing the connection from %s: no complete request in %g s", self.client, self.header_timeout_s
            )
            self.transport.close()


def protocol_class(header_timeout_s: float, max_connections: int, base: type = _Fastest) -> type:
    """uvicorn's HTTP protocol (`base`) with the header deadline and the connection cap: Config(http=...)."""
    return type(
        f"Bounded{base.__name__}",
        (_Bounded, base),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )
