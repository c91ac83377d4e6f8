"""Rank r > 0 of a tensor-parallel worker: a Ray actor holding its slice of
the model and of the KV cache, running the forward pass of every step that
rank 0 broadcasts."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.workers.distributed.step_input import StepInputDecoder
from shoal.workers.engine_args import EngineArgs
from shoal.workers.model_executor.layers.parallel_state import get_tp_group, init_tp_group
from shoal.workers.model_executor.model_loader import build_model, load_model_files, model_weights
from shoal.workers.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class ShardWorker:
    def __init__(self, args: dict, rank: int, size: int, host: str, port: int, backend: str):
        self.args = EngineArgs(**args)
        self.rank, self.size = rank, size
        if self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
        self.store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=120))
        self.backend = backend
        self.runner: ModelRunner | None = None

    def join(self) -> int:
        """Join the group (returns once every rank has joined)."""
        init_tp_group(self.rank, self.size, self.store, self.backend)
        return os.getpid()

    def load(self, max_model_len: int) -> int:
        """Load this rank's slice of the weights; returns how many KV blocks
        this rank's budget holds."""
        args = self.args
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype(self.device)
        loaded = load_model_files(args.model)
        weights = model_weights(loaded, args.load_format, self.device)
        self.model = build_model(
            loaded.config,
            weights,
            max_model_len,
            self.device,
            self.dtype,
            args.resolved_weight_dtype(self.device),
            args.fused_ops,
        )
        self.model_max_len = max_model_len
        per_block = ModelRunner.kv_bytes_per_block(loaded.config, args.block_size, self.dtype, self.size)
        return ModelRunner.kv_budget_bytes(args, self.device) // per_block

    def init_cache(self, num_blocks: int, eos_token_ids: list[int]) -> None:
        """Allocate this rank's KV cache (and load its attention kernel)."""
        args = self.args
        # No CUDA graphs under tensor parallelism: rank 0 runs every step eagerly too.
        self.runner = ModelRunner(
            self.model,
            args.block_size,
            eos_token_ids,
            args.attention_backend,
            self.model_max_len,
            args.max_num_seqs,
            enforce_eager=True,
            cpu_kernels=args.cpu_kernels,
        )
        self.runner.initialize_kv_cache(num_blocks)

    def run(self) -> None:
        """Run every step rank 0 broadcasts until it sends None. A failure
        ends this process: rank 0's next collective then fails at once
        instead of waiting on a rank that will never answer."""
        try:
            runner = self.runner
            decoder = StepInputDecoder()
            tp = get_tp_group()
            while (step := tp.broadcast_object()) is not None:
                scheduled = decoder.decode(step)
                runner.execute_model(scheduled)
                decoder.advance(scheduled)
        except BaseException as e:  # rank 0 gone (the usual end of a replica), or this rank failed
            first_line = (str(e).splitlines() or [""])[0]
            logger.warning("tensor-parallel rank %d stops: %s: %s", self.rank, type(e).__name__, first_line)
            os._exit(1)
