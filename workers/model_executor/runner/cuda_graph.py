"""CUDA graphs for decode-only steps.

A decode step of a small model is a few thousand short kernels; launched
one by one from Python, the GPU waits on the host most of the step. A graph
records them once and replays them with one launch. Graphs fix every shape
and address, so decode batches are padded up to one of a few bucket sizes,
each captured at start-up over one static input buffer that every step's
inputs are copied into. Mixed and prefill steps stay eager.

Padding rows are one-token sequences of length 1 whose key and value go to
a spare KV block the block manager never hands out, so they touch nothing
real; their logits are dropped.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from shoal.workers.model_executor.runner.staging_buffer import StagedBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (which is always one)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1; got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs (sizes ascending); None when
    none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(slots=True)
class CaptureStats:
    num_graphs: int
    seconds: float
    memory_bytes: int  # device memory the graphs' pool holds

    def describe(self) -> str:
        return f"{self.num_graphs} CUDA graphs captured in {self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB"


@dataclass(slots=True)
class _Entry:
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (no CUDA; the tests' mode)
    inputs: dict[str, torch.Tensor]  # views of the static buffer
    nbytes: int  # the inputs' span at the start of the static buffer
    logits: torch.Tensor | None


class DecodeGraphs:
    """One graph per bucket size over one shared static input buffer.

    make_inputs(size) stages a decode batch of `size` padding rows with the
    model's inputs first; forward(inputs) runs the model on such inputs and
    returns the logits. A step's own batch must be staged by the same code,
    padded to the bucket, so its first bytes have the captured layout.
    """

    def __init__(self, sizes: list[int], device: torch.device, use_graphs: bool = True):
        self.sizes = sorted(sizes)
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.entries: dict[int, _Entry] = {}
        self.static: torch.Tensor | None = None
        self.num_replays = 0  # decode steps served from the static buffer

    def capture(
        self, make_inputs: Callable[[int], StagedBatch], forward: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    ) -> CaptureStats:
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device) if self.use_graphs else 0
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Largest first: smaller graphs then fit in the memory the larger left in the pool.
        for size in reversed(self.sizes):
            batch = make_inputs(size)
            batch.upload()
            if self.static is None:
                self.static = torch.zeros(batch.nbytes, dtype=torch.uint8, device=self.device)
            self.static[: batch.nbytes].copy_(cast(torch.Tensor, batch.device_bytes)[: batch.nbytes])  # uploaded
            inputs = batch.views(self.static)
            graph, logits = None, None
            if self.use_graphs:
                forward(inputs)  # warm-up: Triton compiles, lazy buffers are made, outside the graph
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = forward(inputs)
            self.entries[size] = _Entry(graph, inputs, batch.nbytes, logits)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        used = (torch.cuda.memory_reserved(self.device) - before) if self.use_graphs else 0
        stats = CaptureStats(len(self.entries) if self.use_graphs else 0, time.perf_counter() - t0, used)
        return stats

    def padded_size(self, num_seqs: int) -> int | None:
        return padded_batch_size(num_seqs, self.sizes) if self.entries else None

    def replay(
        self, size: int, batch: StagedBatch, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        """Logits of every row of an uploaded batch padded to `size`."""
        e = self.entries[size]
        self.num_replays += 1
        # One device-to-device copy of the step's model inputs into the graph's.
        static, staged = cast(torch.Tensor, self.static), cast(torch.Tensor, batch.device_bytes)  # captured, uploaded
        static[: e.nbytes].copy_(staged[: e.nbytes])
        if e.graph is None:
            return forward(e.inputs)
        e.graph.replay()
        return cast(torch.Tensor, e.logits)  # captured with the graph
