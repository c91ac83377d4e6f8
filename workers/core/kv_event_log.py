"""The engine's KV event log (--enable-kv-cache-events): the last
MAX_BATCHES steps' events (proto/kv_events.py), numbered, for subscribers
that read from where they left off. One that falls further behind gets an
AllBlocksCleared first and rebuilds its view from the events that follow
(and the routing poll's hashes): nothing is held for a slow reader."""

from __future__ import annotations

import threading
import time
from collections import deque

from shoal.proto.kv_events import AllBlocksCleared, KVEventBatch

MAX_BATCHES = 4096


class KVEventLog:
    def __init__(self, max_batches: int = MAX_BATCHES):
        self.batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self.last_seq = 0
        self._lock = threading.Lock()  # appended on the engine's thread, read on the worker's event loop

    def append(self, events: list) -> None:
        """One step's events (nothing for an empty step)."""
        if not events:
            return
        with self._lock:
            self.last_seq += 1
            self.batches.append(KVEventBatch(self.last_seq, time.time(), events))

    def since(self, after: int) -> list[KVEventBatch]:
        """The batches after number `after`; if some of them are gone, a
        batch of AllBlocksCleared comes first (numbered as the first kept
        one's predecessor)."""
        with self._lock:
            if after >= self.last_seq:
                return []
            out = [b for b in self.batches if b.seq > after]
        if out and out[0].seq != after + 1:
            out.insert(0, KVEventBatch(out[0].seq - 1, out[0].ts, [AllBlocksCleared()]))
        return out
