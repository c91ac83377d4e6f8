"""One rank of a worker replica (vLLM's gpu_worker.Worker, for any device):
its device, its model (its slice of it under tensor parallelism), its
runner and KV cache, and its part of each step. Rank 0 lives in the
engine's process and samples; ranks 1..K-1 are Ray actors
(executor/ray_executor.py) that run the forward pass of every step rank 0
broadcasts. The executor calls the steps in order: init_device,
load_model, determine_num_blocks, init_cache, warm_up, then execute_model
(rank 0) or start_worker_execution_loop (the others).

Named RankWorker, not Worker: workers/worker.py's Worker is the Serve replica.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from shoal.proto.model_files import resolve_model
from shoal.proto.utils import cdiv
from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.distributed.step_input import StepInputDecoder, StepInputEncoder
from shoal.workers.engine_args import EngineArgs
from shoal.workers.kv_transfer import cluster_tier
from shoal.workers.kv_transfer.base import KVConnectorBase, KVConnectorRole
from shoal.workers.kv_transfer.factory import connector_name, kv_cache_spec, make_connector
from shoal.workers.kv_transfer.keys import checkpoint_digest, engine_fingerprint
from shoal.workers.model_executor.layers.attention.kv_cache import kv_cache_torch_dtype
from shoal.workers.model_executor.layers.parallel_state import get_tp_group, init_tp_group
from shoal.workers.model_executor.layers.quantization import get_quantization_config
from shoal.workers.model_executor.loader.model_loader import (
    LoadedModel,
    build_model,
    load_model_files,
    model_weights,
    resolve_quantization,
    weight_bytes,
)
from shoal.workers.model_executor.memory.cpu_memory import keep_freed_memory_mapped
from shoal.workers.model_executor.memory.memory_profiler import (
    check_weights_fit,
    estimate_weight_bytes,
    plan_kv_cache_blocks,
    profile_memory,
)
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.platforms.cpu.precision import compute_dtype, cpu_bf16_compute
from shoal.workers.model_executor.runner.cuda_graph import CaptureStats
from shoal.workers.model_executor.runner.interface import DeviceRunner, Runner
from shoal.workers.model_executor.runner.model_runner import ModelRunner
from shoal.workers.model_executor.runner.simulated_runner import SimulatedRunner, load_cost_model

logger = logging.getLogger(__name__)
RENDEZVOUS_TIMEOUT = timedelta(seconds=120)


@dataclass(slots=True)
class DistributedInit:
    """Where a rank joins its tensor-parallel group: the rendezvous store
    at host:port (rank 0 hosts it and passes it as `store`; the other ranks
    connect) and the collective backend."""

    host: str
    port: int
    backend: str  # nccl on GPUs, gloo on CPU
    store: dist.TCPStore | None = None


class RankWorker:
    def __init__(
        self,
        args: EngineArgs,
        rank: int = 0,
        size: int = 1,
        distributed: DistributedInit | None = None,
        kv_store=None,
    ):
        """Holds nothing yet (it may be built as a Ray actor): init_device starts it.
        kv_store: the cluster tier's store (a KVStore handle) for a rank in a process of its own."""
        self.args, self.rank, self.size = args, rank, size
        self.kv_store = kv_store
        self.distributed = distributed  # needed when size > 1
        self.runner: Runner | None = None  # a ModelRunner, or a SimulatedRunner for load_format 'simulated'
        self.cuda_graphs: CaptureStats | None = None
        # Rank 0 of a group sends each step's inputs; the other ranks mirror them.
        self.encoder = StepInputEncoder() if size > 1 and rank == 0 else None
        self._kv_fingerprint: bytes | None = None

    def init_device(self) -> None:
        """This rank's device, dtypes and threads; joins the group (returns
        once every rank has joined) when size > 1."""
        args = self.args
        # A simulated engine holds no tensors; its KV budget is the CPU's unless sized as asked.
        self.device = torch.device("cpu") if args.load_format == "simulated" else args.resolved_device()
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.dtype = args.resolved_dtype(self.device)
        self.weight_dtype = args.resolved_weight_dtype(self.device)  # refuses a bad pairing before loading anything
        self.kv_cache_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)  # sizes the KV blocks
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        if self.kv_store is not None:  # before the KV connector looks for it
            cluster_tier.use_store_handle(self.kv_store)
        if self.size > 1:
            d = cast(DistributedInit, self.distributed)  # passed where size > 1
            store = d.store or dist.TCPStore(d.host, d.port, self.size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
            init_tp_group(self.rank, self.size, store, d.backend, args.enable_expert_parallel)
            self.store = store  # the group talks through it while it lives

    def load_model(self, max_model_len: int, loaded: LoadedModel | None = None) -> None:
        """This rank's model and its runner. loaded: the model's files as
        the engine opened them (it read their config); else opened here."""
        args = self.args
        if loaded is None:
            loaded = load_model_files(args.model)
        cfg = loaded.config
        self.model_config: ModelConfig = cfg
        self.max_model_len = max_model_len
        eos_token_ids = list(cfg.eos_token_ids)
        if args.load_format == "simulated":  # no weights are read: a stand-in model with the cost model's step time
            self.runner = SimulatedRunner(cfg.vocab_size, eos_token_ids, load_cost_model(args.simulated_cost_model))
            return
        quantization = resolve_quantization(args.quantization, loaded, self.device.type, args.load_format)
        quant_cls = get_quantization_config(quantization)
        quant_config = None if quant_cls is None else quant_cls.from_config(cfg.hf_config)
        if self.device.type == "cuda":
            # Refuse a model too big for the card before allocating any of it (weights stored quantized at their size).
            linear_bytes = None if quant_config is None else quant_config.linear_weight_bytes(self.dtype)
            check_weights_fit(
                estimate_weight_bytes(cfg, self.dtype, self.size, args.enable_expert_parallel, linear_bytes),
                torch.cuda.mem_get_info(self.device)[1],
                args.gpu_memory_utilization,
            )
        model = build_model(
            cfg,
            model_weights(loaded, args.load_format, self.device, quantization),
            max_model_len,
            self.device,
            self.dtype,
            self.weight_dtype,
            args.fused_ops,
            quant_config,
        )
        self.weight_bytes = weight_bytes(model)
        logger.info("weights: %.1f MiB (%s)", self.weight_bytes / 2**20, quantization or "unquantized")
        why = ""
        if self.device.type == "cpu" and "bfloat16" in (args.dtype, args.weight_dtype):
            why = f" ({cpu_bf16_compute()[1]})"  # whether bfloat16 was computed as asked, and why
        stored = str(self.weight_dtype).removeprefix("torch.")
        logger.info("compute dtype: %s, weight matrices stored in %s%s", compute_dtype(model), stored, why)
        self.runner = ModelRunner(
            model,
            args.block_size,
            eos_token_ids,
            args.attention_backend,
            max_model_len,
            args.max_num_seqs,
            # No CUDA graphs under tensor parallelism: every rank runs every step eagerly.
            enforce_eager=args.enforce_eager or self.size > 1,
            cpu_kernels=args.cpu_kernels,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if args.enable_lora:
            self.runner.enable_lora(
                args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.resolved_lora_dtype(self.device)
            )

    def determine_num_blocks(self) -> int:
        """KV blocks this rank's budget holds: as asked; on one GPU, vLLM's
        way (the utilization share of the card, less the weights and the
        activation peak of one profiling forward at the largest step); else
        ModelRunner.kv_budget_bytes. Each rank holds only its own heads: the
        same bytes hold about `size` times the blocks."""
        args, device = self.args, self.device
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, args.block_size, self.kv_cache_dtype, self.size)
        if args.num_kv_blocks is not None:
            num_blocks = args.num_kv_blocks
        elif args.kv_cache_memory_bytes is not None or device.type != "cuda" or self.size > 1:
            # Ranks cannot profile one at a time: each forward waits on the others.
            num_blocks = ModelRunner.kv_budget_bytes(args, device) // per_block
        else:
            num_blocks = self._profile_num_blocks(per_block)
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {per_block} bytes")
        return num_blocks

    def _profile_num_blocks(self, per_block: int) -> int:
        args, runner = self.args, cast(DeviceRunner, self.runner)  # on one GPU: a ModelRunner
        runner.initialize_kv_cache(runner.profile_num_blocks(args.max_num_batched_tokens))
        try:
            profile = profile_memory(
                self.device, lambda: runner.profile_run(args.max_num_batched_tokens, args.max_num_seqs)
            )
        finally:
            runner.release_kv_cache()
        logger.info("memory: %s", profile.describe())
        # At least one request of max_model_len must fit.
        return plan_kv_cache_blocks(
            profile, args.gpu_memory_utilization, per_block, cdiv(self.max_model_len, args.block_size)
        )

    def init_cache(self, num_blocks: int) -> None:
        """Allocate this rank's KV cache (and bind its attention kernel), and
        the KV connector's worker side beside it, if one is asked for."""
        cast(Runner, self.runner).initialize_kv_cache(num_blocks)  # load_model set it
        if isinstance(self.runner, ModelRunner) and connector_name(self.args) is not None:
            spec = kv_cache_spec(
                self.model_config, self.args.block_size, self.kv_cache_dtype, self.size, self.kv_fingerprint()
            )
            connector = cast(KVConnectorBase, make_connector(self.args, KVConnectorRole.WORKER, spec))
            connector.register_kv_caches(cast(torch.Tensor, self.runner.kv_cache))
            self.runner.kv_connector = connector
        if isinstance(self.runner, ModelRunner):
            per_block = ModelRunner.kv_bytes_per_block(
                self.model_config, self.args.block_size, self.kv_cache_dtype, self.size
            )
            logger.info(
                "memory of rank %d: weights %.1f MiB, KV cache %.1f MiB (%d blocks of %d tokens)",
                self.rank,
                self.weight_bytes / 2**20,
                num_blocks * per_block / 2**20,
                num_blocks,
                self.args.block_size,
            )

    def kv_fingerprint(self) -> bytes:
        """What this rank's KV blocks depend on beyond their tokens (kv_transfer/keys.py): the same on every
        rank of a group, and for every engine with the same checkpoint and settings."""
        if self._kv_fingerprint is None:
            args = self.args
            self._kv_fingerprint = engine_fingerprint(
                checkpoint_digest(resolve_model(args.model)),
                dtype=str(self.dtype),
                weight_dtype=str(self.weight_dtype),
                quantization=f"{args.quantization}@{self.device.type}",
                kv_cache_dtype=str(self.kv_cache_dtype),
                block_size=args.block_size,
                tp_size=self.size,
            )
        return self._kv_fingerprint

    def warm_up(self) -> None:
        """Capture CUDA graphs of decode steps: on CUDA, with a varlen
        backend, on one rank, unless enforce_eager."""
        runner = cast(ModelRunner, self.runner)  # read only on CUDA, where runners are ModelRunners
        if self.device.type == "cuda" and runner.varlen and not runner.enforce_eager and self.size == 1:
            self.cuda_graphs = runner.capture_cudagraphs()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's step: the other ranks get its inputs and run its forward
        alongside; only this rank samples."""
        if self.encoder is not None:
            step = self.encoder.encode(sched)
            manager = getattr(self.runner, "lora_manager", None)
            if manager is not None:  # the other ranks fill their slots from these, never from disk
                step.lora_adapters = manager.adapters_to_send(sched.lora_slots)
            get_tp_group().broadcast_object(step)
        return cast(Runner, self.runner).execute(sched)  # load_model set it

    def stop_worker_execution_loop(self) -> None:
        """Rank 0: end the other ranks' loops."""
        get_tp_group().broadcast_object(None)

    def start_worker_execution_loop(self) -> None:
        """Ranks 1..K-1: run every step rank 0 broadcasts until it sends
        None. A failure ends this process: rank 0's next collective then
        fails at once instead of waiting on a rank that will never answer."""
        try:
            runner = cast(ModelRunner, self.runner)  # ranks 1..K-1 run a model (execute_model)
            decoder = StepInputDecoder()
            tp = get_tp_group()
            while (step := tp.broadcast_object()) is not None:
                scheduled = decoder.decode(step)
                runner.execute_model(
                    scheduled, step.lora_slots, step.lora_adapters, step.kv_connector_metadata, step.kv_wait_s
                )
                decoder.advance(scheduled)
            if runner.kv_connector is not None:  # rank 0 ended the loop: the disk writes asked for are done
                runner.kv_connector.shutdown()  # before the actor is killed
        except BaseException as e:  # rank 0 gone (the usual end of a replica), or this rank failed
            first_line = (str(e).splitlines() or [""])[0]
            logger.warning("tensor-parallel rank %d stops: %s: %s", self.rank, type(e).__name__, first_line)
            os._exit(1)
