"""The host tier: KV blocks evicted from the paged pool, kept in host memory.

The scheduler side keeps the index (HostTierIndex: key -> slot, least
recently used first); the worker side keeps the slots (HostTierStorage: one
tensor [slots, 2, layers, block_size, kv_heads, head_dim], so a block is one
contiguous copy across layers, not one copy a layer). Both sides size the
tier the same way from the same settings, so a slot number means the same
on both.

On a CPU worker the paged pool is in host memory already: the tier is worth
having as a second, denser level (--kv-offload-dtype bfloat16 holds twice the
blocks of a float32 pool in the same bytes), and as the first stop of the
disk and cluster tiers.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from shoal.workers.kv_transfer.base import KVCacheSpec
from shoal.workers.kv_transfer.host_memory import host_empty


def block_shape(spec: KVCacheSpec) -> tuple[int, ...]:
    """One block across every layer: keys and values."""
    return (2, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)


def num_host_slots(spec: KVCacheSpec, host_bytes: int, dtype: torch.dtype) -> int:
    """Slots of host_bytes, the bytes of all ranks together (as vLLM's
    --kv-offloading-size): each rank keeps its slice of every slot."""
    per_block = torch.Size(block_shape(spec)).numel() * torch.empty(0, dtype=dtype).element_size()
    return host_bytes // (per_block * spec.num_ranks)


class HostTierIndex:
    """Which key each slot holds. A slot being read by this step's loads is
    pinned: a save of the same step never takes it."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()
        self.num_evictions = 0
        self.evicted: list[bytes] = []  # keys evicted since the owner last took them (and cleared this)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, key: bytes) -> int | None:
        return self.slots.get(key)

    def touch(self, key: bytes) -> int:
        self.slots.move_to_end(key)
        return self.slots[key]

    def pin(self, key: bytes) -> int:
        slot = self.touch(key)
        self.pinned.add(slot)
        return slot

    def unpin_all(self) -> None:
        self.pinned.clear()

    def allocate(self, key: bytes) -> int | None:
        """A slot for key (known already: its slot), evicting the least
        recently used unpinned key if none is free; None if every slot is pinned."""
        if key in self.slots:
            return self.touch(key)
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k, s in self.slots.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.slots.pop(victim)
            self.num_evictions += 1
            self.evicted.append(victim)
        self.slots[key] = slot
        return slot

    def discard(self, key: bytes) -> None:
        """Forget key (its contents proved bad): its slot is free again."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.free.append(slot)


class HostTierStorage:
    """The slots' memory, and the copies between them and the paged cache.

    On a GPU the slots are pinned and the copies run on a stream of their
    own: the host thread queues them and goes on, and the compute stream
    waits for them where a forward needs it (a load before the forward
    that reads its blocks; a save before a forward that may overwrite its
    block). One stream keeps a slot's save and a later load of it in order."""

    def __init__(self, spec: KVCacheSpec, num_slots: int, dtype: torch.dtype, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"
        shape = (num_slots, *block_shape(spec))
        # Pinned beside a GPU; on the CPU, populated now rather than faulted in by the steps that fill it.
        self.data = torch.empty(shape, dtype=dtype, pin_memory=True) if self.cuda else host_empty(shape, dtype)
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def save(self, kv_cache: torch.Tensor, block_ids: list[int], slots: list[int], wait: bool = True) -> None:
        """Paged blocks -> slots (converted to the tier's dtype): on the CPU a copy
        a block, on a device one gather. wait: the compute stream waits for the
        copies (a block about to be overwritten); else barrier() does, later."""
        if kv_cache.device.type == "cpu":  # a gathered temporary is fresh memory: its page faults cost 10x the copy
            for b, s in zip(block_ids, slots, strict=True):
                self.data[s].copy_(kv_cache[:, :, b])
            return
        if self.stream is None:
            blocks = kv_cache[:, :, torch.tensor(block_ids, device=kv_cache.device)]  # [2, layers, n, ...]
            self.data[torch.tensor(slots)] = blocks.permute(2, 0, 1, 3, 4, 5).to("cpu", self.data.dtype)
            return
        compute = torch.cuda.current_stream(kv_cache.device)
        self.stream.wait_stream(compute)  # after the forward that wrote the blocks
        with torch.cuda.stream(self.stream):
            ids = torch.tensor(block_ids, device=kv_cache.device)
            blocks = kv_cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).to(self.data.dtype).contiguous()
            for i, s in enumerate(slots):
                self.data[s].copy_(blocks[i], non_blocking=True)
        if wait:
            compute.wait_stream(self.stream)  # the blocks are read before a later forward overwrites them

    def barrier(self, device: torch.device) -> None:
        """The compute stream waits for every copy queued so far (before a
        forward that may overwrite blocks saved without waiting)."""
        if self.stream is not None:
            torch.cuda.current_stream(device).wait_stream(self.stream)

    def load(self, kv_cache: torch.Tensor, slots: list[int], block_ids: list[int]) -> None:
        """Slots -> paged blocks (converted to the cache's dtype)."""
        if kv_cache.device.type == "cpu":
            for s, b in zip(slots, block_ids, strict=True):
                kv_cache[:, :, b].copy_(self.data[s])
            return
        if self.stream is None:
            src = self.data[torch.tensor(slots)].permute(1, 2, 0, 3, 4, 5)  # [2, layers, n, ...]
            kv_cache[:, :, torch.tensor(block_ids, device=kv_cache.device)] = src.to(kv_cache.device, kv_cache.dtype)
            return
        compute = torch.cuda.current_stream(kv_cache.device)
        self.stream.wait_stream(compute)  # the blocks' earlier readers and writers first
        with torch.cuda.stream(self.stream):
            staged = torch.empty((len(slots), *self.data.shape[1:]), dtype=self.data.dtype, device=kv_cache.device)
            for i, s in enumerate(slots):
                staged[i].copy_(self.data[s], non_blocking=True)
            ids = torch.tensor(block_ids, device=kv_cache.device)
            kv_cache[:, :, ids] = staged.permute(1, 2, 0, 3, 4, 5).to(kv_cache.dtype)
        compute.wait_stream(self.stream)  # the forward reads them
