"""What a process concluded about each distinct spec it checked: None for
accepted, else the reason it was refused. A bounded LRU keyed by the spec's
digest (never its text, which may be 256 KiB), shared by the process's
threads; a spec being checked is checked once however many threads ask."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future


class VerdictCache:
    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._pending: dict[bytes, Future[str | None]] = {}
        self._lock = threading.Lock()
        self.num_computed = self.num_hits = 0

    def get(self, key: bytes, compute: Callable[[], str | None]) -> str | None:
        """The verdict for key, computed by compute() (once, on the first
        caller's thread) when it is not known. An exception from compute is
        no verdict: it propagates, and the next caller computes again."""
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                self.num_hits += 1
                return self._verdicts[key]
            waiting = self._pending.get(key)
            if waiting is None:
                mine: Future[str | None] = Future()
                self._pending[key] = mine
        if waiting is not None:
            return waiting.result()
        try:
            verdict = compute()
        except BaseException as e:
            with self._lock:
                self._pending.pop(key, None)
            mine.set_exception(e)
            raise
        with self._lock:
            self.num_computed += 1
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.max_entries:
                self._verdicts.popitem(last=False)
            self._pending.pop(key, None)
        mine.set_result(verdict)
        return verdict

    def __len__(self) -> int:
        return len(self._verdicts)

    def clear(self) -> None:
        with self._lock:
            self._verdicts.clear()
            self.num_computed = self.num_hits = 0
