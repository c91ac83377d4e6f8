"""The tensor-parallel group of this process: its rank, its size and the
collectives the parallel layers call.

One group per process (torch.distributed's default group). Layers read it
when they are built, so a model built outside any group is the plain
single-card model and never touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that waits this long means a rank is gone: fail, never hang.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass(slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: object = None  # tensors: NCCL on GPUs, gloo on CPU
    cpu_group: object = None  # pickled step inputs: always gloo
    # Mixture-of-experts layers split whole experts across the group (EP)
    # instead of every expert's width; attention is tensor-parallel either way.
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x on rank 0 (in rank order); None elsewhere."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.device_group)
        return parts

    def broadcast_object(self, obj=None):
        """Rank 0 sends obj; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


_group = TPGroup()


def get_tp_group() -> TPGroup:
    return _group


def init_tp_group(rank: int, size: int, store: dist.Store, backend: str, expert_parallel: bool = False) -> TPGroup:
    """Join the group (blocks until every rank has joined); expert_parallel
    as EngineArgs.enable_expert_parallel."""
    global _group
    if _group.size > 1:
        raise RuntimeError("this process already belongs to a tensor-parallel group; shut that engine down first")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    _group = TPGroup(rank, size, world, cpu, expert_parallel)
    return _group


def destroy_tp_group() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()


def num_local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads per rank: split when they divide, else one replicated head."""
    return max(1, num_kv_heads // tp_size)
