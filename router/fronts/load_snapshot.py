"""The workers' loads as last read, for the endpoints that probes and
scrapers call often (/health, /metrics, the status JSON, gRPC GetLoad): a
read is a broadcast to every worker, so a flood of probes must not make one
per call. A caller gets a snapshot at most `max_age_s` old; when it is older,
one refresh runs and every caller meanwhile waits for that same one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shoal.proto.messages import WorkerLoad


class LoadSnapshot:
    # Probes poll every second or so: half of that keeps /health current enough.
    MAX_AGE_S = 0.5

    def __init__(
        self,
        read: Callable[[], Awaitable[list[WorkerLoad]]],
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.read, self.max_age_s, self.clock = read, max_age_s, clock
        self.reads = 0  # broadcasts made, for tests and curiosity
        self._loads: list[WorkerLoad] | None = None
        self._read_at = 0.0  # when the read behind _loads began: its age is counted from there
        self._refresh: asyncio.Future | None = None

    async def get(self) -> list[WorkerLoad]:
        if self._loads is not None and self.clock() - self._read_at <= self.max_age_s:
            return self._loads
        if self._refresh is None:  # single flight: one read at a time, shared by every caller
            self._refresh = asyncio.ensure_future(self._read())
            self._refresh.add_done_callback(_retrieved)
        # shield: a caller that goes away (its client hung up) does not cancel the others' read
        return await asyncio.shield(self._refresh)

    async def _read(self) -> list[WorkerLoad]:
        started = self.clock()
        self.reads += 1
        try:
            loads = await self.read()
        finally:
            self._refresh = None
        self._loads, self._read_at = loads, started
        return loads


def _retrieved(f: asyncio.Future) -> None:
    """Mark a failed read's error as seen (its callers may all have gone away)."""
    if not f.cancelled():
        f.exception()
