"""This router's delta streams: one per worker replica, carrying every delta
of this router's requests there as one batch per engine step
(workers/delta_outbox.py is the worker's end).

A request still goes to its worker on its own Serve stream, so routing,
Serve's in-flight counts, cancellation and a dead worker's errors work as
before; but once this router's stream is open at that worker, the
request's own stream only says Riding (and, if it comes to that, carries a
refusal) while its deltas arrive here. The stream to a worker is opened
when a request's first delta shows which worker took it, so the first
requests to a new worker stream on their own.

A delta stream that ends or breaks ends its riders: their streams raise
WorkerLost and the failover pool resumes them from what the client has.

Every entry keyed by a request goes when its stream ends (close), and a
worker's when its delta stream does. A request's inbox is a StreamBuffer
(stream_buffer.py): its deltas merge while its client lags, and past
max_buffer_tokens waiting the request is aborted, so a client that stops
reading holds a bounded share of this router's memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from shoal.proto.messages import Subscribe
from shoal.router.routing.stream_buffer import StreamBuffer

logger = logging.getLogger(__name__)


class MuxEnded:
    """Put in a rider's inbox when its delta stream ends or breaks."""

    def __init__(self, error: BaseException | None):
        self.error = error


class DeltaMux:
    # A worker answers a subscription at once; past this it is not reachable.
    CONNECT_TIMEOUT_S = 5.0
    # A subscription that did not connect (misrouted, timed out) is tried again after this.
    RETRY_S = 1.0

    # Tokens a request's inbox holds for a client that does not read (--max-stream-buffer-tokens).
    MAX_BUFFER_TOKENS = 4096

    def __init__(self, handle, router_id: str | None = None, max_buffer_tokens: int | None = None):
        self.router_id = router_id or f"router-{os.getpid()}-{id(self):x}"
        self.max_buffer_tokens = max_buffer_tokens or self.MAX_BUFFER_TOKENS
        self._subscribe = handle.options(method_name="subscribe", stream=True, _by_reference=False)
        self._inboxes: dict[str, StreamBuffer] = {}  # request id -> what arrives for it
        self._readers: dict[str, asyncio.Task] = {}  # worker -> its stream's reader
        self._riders: dict[str, set[str]] = {}  # worker -> request ids riding its stream
        self._retry_at: dict[str, float] = {}  # worker -> when to try its stream again (failed lately)
        self.num_batches = self.num_deltas = 0

    # ---- requests ---------------------------------------------------------------

    def open(self, request_id: str, on_overflow=None) -> StreamBuffer:
        """The request's inbox; on_overflow(tokens): its client stopped reading (StreamBuffer)."""
        q = self._inboxes[request_id] = StreamBuffer(self.max_buffer_tokens, on_overflow)
        return q

    def ride(self, request_id: str, worker: str) -> bool:
        """The worker said the request rides this router's stream there;
        False if that stream is not open here (it ended or broke)."""
        if worker not in self._readers:
            return False
        self._riders.setdefault(worker, set()).add(request_id)
        return True

    def close(self, request_id: str, worker: str | None = None) -> None:
        self._inboxes.pop(request_id, None)
        if worker is not None and (riders := self._riders.get(worker)) is not None:
            riders.discard(request_id)
            if not riders:
                del self._riders[worker]

    @property
    def num_request_entries(self) -> int:
        """Inboxes and rider entries held: requests in flight here."""
        return len(self._inboxes) + sum(len(r) for r in list(self._riders.values()))

    # ---- streams ----------------------------------------------------------------

    def connect(self, worker: str) -> None:
        """Open this router's stream at `worker` unless it is open, opening,
        or failed to connect a moment ago."""
        if worker in self._readers:
            return
        if (at := self._retry_at.get(worker)) is not None:
            if time.monotonic() < at:
                return
            del self._retry_at[worker]
        self._readers[worker] = asyncio.get_running_loop().create_task(self._read(worker), name=f"shoal-mux-{worker}")

    async def _read(self, worker: str) -> None:
        gen = self._subscribe.remote(Subscribe(self.router_id, worker))
        error: BaseException | None = None
        connected = ended = False
        try:
            await asyncio.wait_for(gen.__anext__(), self.CONNECT_TIMEOUT_S)  # the worker's empty hello
            connected = True
            logger.info("delta stream from worker %s open", worker)
            inboxes = self._inboxes
            async for batch in gen:
                self.num_batches += 1
                self.num_deltas += len(batch)
                for request_id, delta in batch:
                    q = inboxes.get(request_id)
                    if q is not None:
                        q.put(delta)
            ended = True
        except StopAsyncIteration:  # the subscription reached another replica, which declined it
            ended = True
        except asyncio.CancelledError:
            error = ConnectionError("the router closed its delta stream")
            raise
        except Exception as e:  # the worker died, or never answered
            error = e
        finally:
            del self._readers[worker]
            if not connected:
                now = time.monotonic()
                for w in [w for w, at in self._retry_at.items() if at <= now]:  # workers long gone go
                    del self._retry_at[w]
                self._retry_at[worker] = now + self.RETRY_S
            if not ended:
                gen.cancel()
            riders = self._riders.pop(worker, ())
            if riders and error is None:
                error = ConnectionError(f"worker {worker}'s delta stream ended with requests riding on it")
            for request_id in riders:
                if (q := self._inboxes.get(request_id)) is not None:
                    q.put(MuxEnded(error))
            if error is not None and connected:
                logger.warning(
                    "delta stream from worker %s ended: %s (%d requests riding)",
                    worker,
                    str(error).splitlines()[0] if str(error) else type(error).__name__,
                    len(riders),
                )
