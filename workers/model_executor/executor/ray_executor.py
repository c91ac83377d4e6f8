"""Tensor parallelism: rank 0 in this process, ranks 1..K-1 as Ray actors
(RankWorker all) in one STRICT_PACK placement group (one bundle per GPU),
joined by torch.distributed (NCCL on GPUs, gloo on CPU).

Inside a Ray Serve replica the placement group is the replica's own (the
replica sits in bundle 0); elsewhere (the offline LLM) it is made here, and
bundle 0 stays reserved for this process.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import torch.distributed as dist

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.distributed.placement import tp_bundles
from shoal.workers.engine_args import EngineArgs
from shoal.workers.kv_transfer import cluster_tier
from shoal.workers.model_executor.layers.parallel_state import destroy_tp_group
from shoal.workers.model_executor.loader.model_loader import LoadedModel
from shoal.workers.model_executor.runner.rank_worker import RENDEZVOUS_TIMEOUT, DistributedInit, RankWorker

PLACEMENT_TIMEOUT_S = 120.0


class RayExecutor:
    driver_worker: RankWorker  # rank 0, in this process: set before anything reads it

    def __init__(self, args: EngineArgs, loaded: LoadedModel, max_model_len: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size = args.tensor_parallel_size
        gpu = args.resolved_device().type == "cuda"
        if not gpu and not args.num_threads:
            # The ranks share this machine's cores.
            args = dataclasses.replace(args, num_threads=max(1, (os.cpu_count() or 1) // size))
        self.workers: list = []  # ranks 1..K-1: actor handles, in rank order
        self.loops: list = []  # their step loops, once started
        self._own_pg = None
        self._owns_ray = not ray.is_initialized()
        try:
            if self._owns_ray:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                # ray.init's annotation says int; it takes a level's name too (its own default is "info")
                ray.init(num_cpus=max(os.cpu_count() or 1, size), include_dashboard=False, logging_level="WARNING")  # type: ignore[arg-type]
            pg = self._placement_group(size, gpu)
            # Rendezvous on a port the OS picks (several workers share a machine).
            host = ray.util.get_node_ip_address()
            store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS_TIMEOUT)
            backend = "nccl" if gpu else "gloo"
            rank_args = dataclasses.replace(args, device="cuda") if gpu else args  # each actor sees its GPU as cuda:0
            tag = uuid.uuid4().hex[:8]
            # The cluster tier's store, for the ranks' own processes: the application's, else the job's (made
            # here, so that it is this process's and outlives this engine's ranks).
            kv_store = None
            if args.kv_cluster_tier:
                kv_store = cluster_tier.store_handle() or cluster_tier.job_store(args.kv_cluster_bytes)
            cls = ray.remote(RankWorker)
            for rank in range(1, size):
                bundle = pg.bundle_specs[rank]
                self.workers.append(
                    cls.options(
                        name=f"shoal-tp-{tag}-rank{rank}",
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                    ).remote(rank_args, rank, size, DistributedInit(host, store.port, backend), kv_store)
                )
            self.driver_worker = RankWorker(args, 0, size, DistributedInit(host, store.port, backend, store))
            self.collective_rpc("init_device")
            loads = [w.load_model.remote(max_model_len) for w in self.workers]
            self.driver_worker.load_model(max_model_len, loaded)  # the other ranks load meanwhile
            ray.get(loads)
        except BaseException:
            self.shutdown()
            raise

    def _placement_group(self, size: int, gpu: bool):
        """This replica's placement group, else one made (and later removed) here."""
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group

        pg = get_current_placement_group()
        if pg is None:
            bundles = tp_bundles(size, gpu)
            pg = placement_group(
                bundles, strategy="STRICT_PACK", _soft_target_node_id=ray.get_runtime_context().get_node_id()
            )
            self._own_pg = pg
            if not pg.wait(PLACEMENT_TIMEOUT_S):
                raise RuntimeError(
                    f"tensor_parallel_size {size} needs {bundles} on one node; the cluster has {ray.cluster_resources()}"
                )
        elif pg.bundle_count < size:
            raise RuntimeError(
                f"this replica's placement group has {pg.bundle_count} bundles; "
                f"tensor_parallel_size {size} needs one per rank"
            )
        return pg

    def collective_rpc(self, method: str, *args) -> list:
        """RankWorker.`method` on every rank (rank 0 here while the others
        run it); the results in rank order."""
        import ray

        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return [getattr(self.driver_worker, method)(*args), *ray.get(refs)]

    def determine_num_available_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        """Every rank's cache, then the other ranks' step loops: the engine
        is ready only when every rank is."""
        self.collective_rpc("init_cache", num_blocks)
        self.collective_rpc("warm_up")
        self.loops = [w.start_worker_execution_loop.remote() for w in self.workers]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(sched)

    def check_health(self) -> None:
        """Raise if a rank's loop has ended (its actor died or failed)."""
        import ray

        if not self.loops:
            return
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
                self.driver_worker.stop_worker_execution_loop()
                ray.get(self.loops, timeout=10)
            except Exception:
                pass  # a rank already gone: the actors are killed below
            self.loops = []
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        destroy_tp_group()
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._own_pg)
            self._own_pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
