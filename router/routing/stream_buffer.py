"""One request's deltas between its worker and its front, bounded.

Deltas come in as fast as the worker makes them (its own Serve stream, this
router's delta stream: delta_mux.py), whether or not the client reads. While
the front has not taken the last delta, the next ones merge into it (token
ids and logprobs appended, text concatenated, the finish kept once), so a
reader that lags gets one delta for all it missed, and the buffer holds one
merged delta rather than a queue of them. Past `max_tokens` tokens waiting
the request is given up: the buffer drops what it holds, calls `on_overflow`
(which aborts the request at its worker) and hands its reader
StreamBufferFull instead of anything more.

Other items (Riding, refusals, the end of a stream, errors) keep their order
and end the delta before them; a request has a handful of them at most.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from shoal.proto.messages import GenerateDelta


class StreamBufferFull(Exception):
    """The client read none of the last `max_tokens` tokens of its request."""


class _Merged:
    """Deltas merged while the reader lagged (a list of text parts: repeated
    string concatenation would copy the text once per delta)."""

    __slots__ = ("token_ids", "parts", "logprobs", "finished", "load")

    def __init__(self, first: GenerateDelta):
        self.token_ids = list(first.token_ids)
        self.parts = [first.text]
        self.logprobs = None if first.logprobs is None else list(first.logprobs)
        self.finished, self.load = first.finished, first.load

    def add(self, d: GenerateDelta) -> None:
        self.token_ids += d.token_ids
        self.parts.append(d.text)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = list(d.logprobs)
            else:
                self.logprobs += d.logprobs
        self.finished = d.finished
        if d.load is not None:
            self.load = d.load

    def delta(self) -> GenerateDelta:
        return GenerateDelta(self.token_ids, "".join(self.parts), self.logprobs, self.finished, self.load)


class StreamBuffer:
    """put() never waits; get() waits for the next item."""

    def __init__(self, max_tokens: int, on_overflow: Callable[[int], None] | None = None):
        self.max_tokens = max_tokens
        self.on_overflow = on_overflow  # called once with the tokens waiting, when they pass max_tokens
        self._items: deque = deque()
        self._tail: GenerateDelta | _Merged | None = None  # the last item, while deltas may merge into it
        self._waiter: asyncio.Future | None = None
        self.num_tokens = 0  # tokens waiting for the reader
        self.peak_tokens = 0  # the most that ever waited (never past max_tokens)
        self.num_merged = 0  # deltas merged into an earlier one
        self.overflowed = False

    def put(self, item) -> None:
        if self.overflowed:
            return
        if isinstance(item, GenerateDelta):
            tail = self._tail
            if tail is None:
                self._items.append(item)
                self._tail = item
            else:
                if isinstance(tail, GenerateDelta):  # the first merge: the buffer's own copy from here
                    tail = self._tail = self._items[-1] = _Merged(tail)
                tail.add(item)
                self.num_merged += 1
            if item.finished is not None:  # nothing merges into a request's last delta
                self._tail = None
            self.num_tokens += len(item.token_ids)
            if self.num_tokens > self.max_tokens:
                self._overflow()
                return
            self.peak_tokens = max(self.peak_tokens, self.num_tokens)
        else:
            self._items.append(item)
            self._tail = None
        self._wake()

    def _overflow(self) -> None:
        waiting = self.num_tokens
        self.overflowed = True
        self._items.clear()
        self._tail = None
        self.num_tokens = 0
        self._items.append(
            StreamBufferFull(
                f"the client read none of the last {waiting} tokens of its request "
                f"(--max-stream-buffer-tokens {self.max_tokens}); the request was aborted"
            )
        )
        if self.on_overflow is not None:
            self.on_overflow(waiting)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        """The next item: a delta (merged, if several came), or another item;
        StreamBufferFull is returned, not raised."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is self._tail:
            self._tail = None
        if isinstance(item, _Merged):
            item = item.delta()
        if isinstance(item, GenerateDelta):
            self.num_tokens -= len(item.token_ids)
        return item
