"""The adapters held in host memory (vLLM's max_cpu_loras): each one the
tensors checked when its files were read, and the only source a slot is
filled from, so nothing is read from disk inside a step.

Least recently used first out, past `capacity`, but never an adapter in use
(a request under it in the engine) nor one in a device slot: an adapter a
step may need is always here. The fingerprint of every adapter ever put
here stays (until forget), so that one read again after its eviction is
refused if its files changed meanwhile. Read by the engine's thread and the
threads that register adapters: a lock guards it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from shoal.workers.lora.peft_adapter import LoRAAdapter


class LoRAHostCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._digests: dict[int, str] = {}  # lora_int_id -> digest of the files first read
        self._lock = threading.Lock()

    def get(self, lora_int_id: int) -> LoRAAdapter | None:
        with self._lock:
            adapter = self._held.get(lora_int_id)
            if adapter is not None:
                self._held.move_to_end(lora_int_id)
            return adapter

    def digest(self, lora_int_id: int) -> str | None:
        with self._lock:
            return self._digests.get(lora_int_id)

    def put(self, adapter: LoRAAdapter, keep: Iterable[int] = ()) -> None:
        """Hold `adapter`, then evict down to capacity, sparing those in `keep` (in use, in a slot)."""
        with self._lock:
            self._held[adapter.int_id] = adapter
            self._held.move_to_end(adapter.int_id)
            self._digests.setdefault(adapter.int_id, adapter.digest)
            spare = set(keep) | {adapter.int_id}
            for aid in [a for a in self._held if a not in spare]:
                if len(self._held) <= self.capacity:
                    break
                del self._held[aid]

    def forget(self, lora_int_id: int) -> None:
        """An adapter no longer served: its tensors and its fingerprint go."""
        with self._lock:
            self._held.pop(lora_int_id, None)
            self._digests.pop(lora_int_id, None)

    def ids(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def __len__(self) -> int:
        return len(self._held)
