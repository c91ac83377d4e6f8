"""Which adapter sits in which of the max_loras device slots: the
scheduler's residency table.

A sequence under an adapter holds a pin on its slot from the step it is
admitted until it finishes or is preempted, so the running sequences never
use more than max_loras adapters and an adapter in use is never evicted.
An adapter not resident takes a free slot, else the least recently used
slot whose adapter no running sequence holds; when every slot is pinned,
the sequence waits. Loading the weights into a slot is the model runner's
(LoRAModelManager), told by each step's SchedulerOutput.lora_slots.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlotTable:
    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {max_loras}")
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.requests: dict[int, object] = {}  # slot -> the adapter in it (a workers.lora LoRARequest)
        self.pins: dict[int, int] = {}  # adapter id -> sequences holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident adapter ids, least recent first
        self.num_loads = 0  # adapters put in a slot (each a copy in the model runner)

    def acquire(self, request) -> int | None:
        """A pin on request's adapter and its slot, or None (nothing taken) when no slot can be had."""
        aid = request.lora_int_id
        slot = self.slot_of.get(aid)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.slot_of[aid], self.requests[slot] = slot, request
            self.num_loads += 1
        self.pins[aid] = self.pins.get(aid, 0) + 1
        self._lru[aid] = None
        self._lru.move_to_end(aid)
        return slot

    def release(self, request) -> None:
        aid = request.lora_int_id
        n = self.pins.get(aid, 0)
        if n <= 0:
            raise RuntimeError(f"LoRA adapter {aid} released more often than acquired")
        self.pins[aid] = n - 1

    def _free_slot(self) -> int | None:
        used = set(self.requests)
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for aid in self._lru:  # least recently used first
            if self.pins.get(aid, 0) == 0:
                slot = self.slot_of.pop(aid)
                del self.requests[slot], self._lru[aid]
                self.pins.pop(aid, None)
                return slot
        return None

    @property
    def active(self) -> set[int]:
        """Adapter ids some sequence holds now."""
        return {aid for aid, n in self.pins.items() if n > 0}
