"""Rank 0's view of a tensor-parallel worker: the other ranks as Ray
actors in one STRICT_PACK placement group (one bundle per GPU), joined to
this process by torch.distributed (NCCL on GPUs, gloo on CPU).

Inside a Ray Serve replica the placement group is the replica's own (the
replica sits in bundle 0); elsewhere (the offline LLM) it is made here, and
bundle 0 stays reserved for this process.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.workers.distributed.placement import tp_bundles
from shoal.workers.engine_args import EngineArgs
from shoal.workers.model_executor.layers.parallel_state import destroy_tp_group, init_tp_group

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 120.0


class ShardGroup:
    def __init__(self, args: EngineArgs, tp_size: int, device: torch.device):
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from shoal.workers.distributed.shard_worker import ShardWorker

        self.size = tp_size
        self.actors: list = []
        self.loops: list = []
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(num_cpus=max(os.cpu_count() or 1, tp_size), include_dashboard=False, logging_level="WARNING")
        pg = get_current_placement_group()
        self._own_pg = None
        if pg is None:
            bundles = tp_bundles(tp_size, device.type == "cuda")
            pg = placement_group(
                bundles, strategy="STRICT_PACK", _soft_target_node_id=ray.get_runtime_context().get_node_id()
            )
            self._own_pg = pg
            if not pg.wait(PLACEMENT_TIMEOUT_S):
                self.shutdown()
                raise RuntimeError(
                    f"tensor_parallel_size {tp_size} needs {bundles} on one node; "
                    f"the cluster has {ray.cluster_resources()}"
                )
        elif pg.bundle_count < tp_size:
            raise RuntimeError(
                f"this replica's placement group has {pg.bundle_count} bundles; "
                f"tensor_parallel_size {tp_size} needs one per rank"
            )
        self._remove_pg = remove_placement_group

        # Rendezvous on a port the OS picks (several workers share a machine).
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, tp_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        backend = "nccl" if device.type == "cuda" else "gloo"
        shard_args = asdict(args)
        if device.type == "cuda":
            shard_args["device"] = "cuda"  # each actor sees its own GPU as cuda:0
        tag = uuid.uuid4().hex[:8]
        cls = ray.remote(ShardWorker)
        try:
            for rank in range(1, tp_size):
                bundle = pg.bundle_specs[rank]
                self.actors.append(
                    cls.options(
                        name=f"shoal-tp-{tag}-rank{rank}",
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                    ).remote(shard_args, rank, tp_size, host, store.port, backend)
                )
            joins = [a.join.remote() for a in self.actors]
            self.group = init_tp_group(0, tp_size, store, backend)
            ray.get(joins)
        except BaseException:
            self.shutdown()
            raise
        self.store = store  # the other ranks keep talking to it while the group lives

    def load(self, max_model_len: int) -> None:
        """Start loading on every other rank (rank 0 loads meanwhile)."""
        self._loading = [a.load.remote(max_model_len) for a in self.actors]

    def wait_loaded(self) -> list[int]:
        """How many KV blocks each other rank's budget holds, once loaded."""
        import ray

        return ray.get(self._loading)

    def start(self, num_blocks: int, eos_token_ids: list[int]) -> None:
        """Give every other rank its cache, then start their step loops: the
        engine is ready only when every rank is."""
        import ray

        ray.get([a.init_cache.remote(num_blocks, eos_token_ids) for a in self.actors])
        self.loops = [a.run.remote() for a in self.actors]

    def send(self, step) -> None:
        """Broadcast one step's inputs; every rank then runs the forward."""
        self.group.broadcast_object(step)

    def check_health(self) -> None:
        """Raise if a rank's loop has ended (its actor died or failed)."""
        import ray

        ready, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        for ref in ready:
            rank = self.loops.index(ref) + 1
            try:
                ray.get(ref)
            except Exception as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone: {type(e).__name__}") from e
            raise RuntimeError(f"tensor-parallel rank {rank} stopped")

    def shutdown(self) -> None:
        """Stop the loops, the actors and the group; free the placement group."""
        import ray

        if self.loops:
            try:
                self.check_health()
                self.send(None)
                ray.get(self.loops, timeout=10)
            except Exception:
                pass  # a rank already gone: the actors are killed below
            self.loops = []
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        destroy_tp_group()
        if self._own_pg is not None:
            self._remove_pg(self._own_pg)
            self._own_pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
