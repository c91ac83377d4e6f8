"""A router's delta stream at one worker: every delta of that router's
requests here, sent as one batch per engine step.

Without it each streamed token is one item on its request's own Serve
stream, and each item costs the worker's and the router's processes a Serve
hop (~0.3 ms each on this class of CPU): with tens of requests running,
that is several percent of the cores the engine steps on. A router that
sends a worker requests opens one stream there (Worker.subscribe); the
deltas of one step, from all of that router's requests, travel as one list.

The stream ends by itself once the router has no request here for
IDLE_S, so a draining worker is never held up by it, and the router opens
it again when it next needs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from shoal.proto.messages import GenerateDelta

# A stream with no request of its router for this long ends.
IDLE_S = 2.0


class DeltaOutbox:
    """The deltas waiting to go out on one router's stream."""

    def __init__(self, idle_s: float | None = None):
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self.items: list[tuple[str, GenerateDelta]] = []
        self.riders = 0  # requests whose deltas ride here, from their start to their end
        self.closed = False
        self._event = asyncio.Event()

    def join(self) -> None:
        self.riders += 1

    def leave(self) -> None:
        self.riders -= 1
        self._event.set()

    def put(self, request_id: str, delta: GenerateDelta) -> None:
        self.items.append((request_id, delta))
        self._event.set()

    async def batches(self) -> AsyncIterator[list[tuple[str, GenerateDelta]]]:
        """Yields an empty list first (the subscriber knows it is connected),
        then whatever was put since the last batch, once per wake-up: the
        requests of one engine step all put theirs before this runs again.
        Ends after idle_s with no rider and nothing to send. Once it ends
        (or its subscriber goes), the box is closed and holds nothing."""
        try:
            yield []
            while True:
                if self.items:
                    items, self.items = self.items, []
                    yield items
                    continue
                self._event.clear()
                try:
                    await asyncio.wait_for(self._event.wait(), self.idle_s)
                except TimeoutError:
                    if not self.riders and not self.items:
                        return
        finally:
            self.closed = True  # riders see it and stop putting (Worker.generate)
            self.items = []
