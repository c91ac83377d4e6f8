"""How much of a GPU the KV cache may take (vLLM's --gpu-memory-utilization).

The engine may use `utilization` of the card's total memory. Out of that
come the weights, the activation peak of one profiling forward at the
largest token budget, and the memory torch did not allocate (the CUDA
context, NCCL buffers, other libraries, other processes); the KV cache gets
the rest:

    kv_cache = total * utilization - weights - activation_peak - non_torch

As in vLLM (gpu_worker.determine_available_memory): the activation peak is
torch's peak allocated bytes during the profile run less what was allocated
before it, and non-torch memory is the card's used memory (cudaMemGetInfo)
less what torch's caching allocator has reserved.

A model that cannot hold one max_model_len sequence's blocks is refused at
start with the figures (`plan_kv_cache_blocks`); one whose weights alone
exceed the budget is refused before they are loaded (`check_weights_fit`
with `estimate_weight_bytes`).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.layers.parallel_state import num_local_kv_heads
from shoal.workers.model_executor.models.config import ModelConfig

GiB = 1 << 30

_KNOBS = (
    "To fit: raise --gpu-memory-utilization (at most 1.0), lower --max-model-len (fewer KV blocks per "
    "sequence), lower --max-num-batched-tokens (a smaller activation peak), raise --tensor-parallel-size "
    "(weights and KV heads split across GPUs), or choose a smaller --dtype (bfloat16 or float16 "
    "instead of float32)."
)


class InsufficientMemoryError(RuntimeError):
    """The model, or one sequence's KV cache beside it, does not fit the GPU
    memory the engine may use. The message gives the figures and the knobs."""


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def check_utilization(utilization: float) -> float:
    """The share of the card the engine may use: a number in (0, 1]."""
    ok = isinstance(utilization, (int, float)) and not isinstance(utilization, bool)
    if not ok or not 0 < utilization <= 1:  # NaN fails the comparison too
        raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {utilization!r}")
    return float(utilization)


@dataclass(slots=True)
class MemoryProfile:
    """One device's memory in bytes, measured after the weights were loaded
    and one profiling forward ran."""

    total_bytes: int  # the card
    weights_bytes: int  # allocated by torch before the profile forward
    activation_peak_bytes: int  # torch's peak during the forward, less weights_bytes
    non_torch_bytes: int  # used on the card but not reserved by torch

    def kv_cache_bytes(self, utilization: float) -> int:
        """What the KV cache may take; negative when the rest alone exceed the budget."""
        budget = int(self.total_bytes * check_utilization(utilization))
        return budget - self.weights_bytes - self.activation_peak_bytes - self.non_torch_bytes

    def describe(self, utilization: float | None = None) -> str:
        """The figures in GiB, in one line; with `utilization`, the KV cache's share too."""
        line = (
            f"total {gib(self.total_bytes)}, weights {gib(self.weights_bytes)}, "
            f"activation peak {gib(self.activation_peak_bytes)}, non-torch {gib(self.non_torch_bytes)}"
        )
        if utilization is not None:
            line += f", KV cache {gib(self.kv_cache_bytes(utilization))} at gpu_memory_utilization {utilization:g}"
        return line


class MemorySnapshot(NamedTuple):
    """One reading of a CUDA device, in bytes."""

    free: int  # cudaMemGetInfo
    total: int
    allocated: int  # torch.cuda.memory_allocated: live tensors
    reserved: int  # torch.cuda.memory_reserved: held by the caching allocator

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))

    @property
    def non_torch(self) -> int:
        """Used on the card but not by torch's allocator: CUDA context, NCCL,
        cuBLAS handles, other processes."""
        return max(0, self.total - self.free - self.reserved)


def profile_from_snapshots(before: MemorySnapshot, after: MemorySnapshot, peak_allocated: int) -> MemoryProfile:
    """The profile from readings taken just before and just after the
    profile forward, and torch's peak allocated bytes in between (its peak
    statistic reset before `before`). Non-torch memory is the larger of the
    two readings: the forward may load kernels and create library handles."""
    return MemoryProfile(
        total_bytes=before.total,
        weights_bytes=before.allocated,
        activation_peak_bytes=max(0, peak_allocated - before.allocated),
        non_torch_bytes=max(before.non_torch, after.non_torch),
    )


def profile_memory(device: torch.device | str, run_forward: Callable[[], None]) -> MemoryProfile:
    """Measure `device` around `run_forward()` (one forward at the largest
    token budget). Call it once the model is loaded and before the KV cache
    is allocated: everything torch has allocated on the device by then is
    counted as weights. CUDA only; a ValueError elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"profile_memory measures a CUDA device; got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        gc.collect()
        torch.cuda.empty_cache()  # cached blocks would hide as torch-reserved
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = MemorySnapshot.take(device)
        try:
            run_forward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            after = MemorySnapshot.take(device)
        finally:
            gc.collect()
            torch.cuda.empty_cache()  # the activations go back to the card for the KV cache
    return profile_from_snapshots(before, after, peak)


def plan_kv_cache_blocks(profile: MemoryProfile, utilization: float, bytes_per_block: int, min_blocks: int) -> int:
    """How many KV blocks of `bytes_per_block` fit what `utilization` leaves.
    Fewer than `min_blocks` (what one max_model_len sequence needs) raises
    InsufficientMemoryError with every figure."""
    if bytes_per_block < 1 or min_blocks < 1:
        raise ValueError(f"bytes_per_block and min_blocks must be >= 1; got {bytes_per_block}, {min_blocks}")
    left = profile.kv_cache_bytes(utilization)
    blocks = max(0, left) // bytes_per_block
    if blocks >= min_blocks:
        return blocks
    budget = int(profile.total_bytes * utilization)
    raise InsufficientMemoryError(
        f"Not enough GPU memory for the KV cache: one sequence of --max-model-len tokens needs {min_blocks} "
        f"blocks ({gib(min_blocks * bytes_per_block)}, {bytes_per_block} bytes a block) and {blocks} fit. "
        f"The card's {gib(profile.total_bytes)} x gpu_memory_utilization {utilization:g} = {gib(budget)}, "
        f"less weights {gib(profile.weights_bytes)}, activation peak {gib(profile.activation_peak_bytes)} and "
        f"non-torch memory {gib(profile.non_torch_bytes)} (CUDA context, other libraries and processes), "
        f"leaves {gib(left)} for the KV cache. {_KNOBS}"
    )


def check_weights_fit(weight_bytes: int, total_bytes: int, utilization: float) -> None:
    """Refuse, before loading, weights that alone exceed total * utilization."""
    budget = int(total_bytes * check_utilization(utilization))
    if weight_bytes > budget:
        raise InsufficientMemoryError(
            f"The model does not fit: its weights take {gib(weight_bytes)} on each GPU, more than the card's "
            f"{gib(total_bytes)} x gpu_memory_utilization {utilization:g} = {gib(budget)}, before any "
            f"activation or KV cache. {_KNOBS}"
        )


def estimate_weight_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    tp_size: int = 1,
    expert_parallel: bool = False,
    linear_bytes: float | None = None,
) -> int:
    """The bytes of the parameters one rank of a `tp_size` group holds, as
    models/llama.py lays them out: vocabulary rows ceil(vocab / tp) on every
    rank (the last rank's tail padded), q heads, MLP width and the o/down
    inputs split by tp, KV heads split or one replicated per rank, norms and
    the o/down biases whole on every rank. A tied LM head is the embedding.
    Buffers (the rotary cos/sin tables) are not parameters and not counted.
    A mixture-of-experts layer holds its router whole and, instead of the
    dense MLP, every expert at 1/tp of its width or, with expert_parallel,
    1/tp of the experts whole (models/moe.py). linear_bytes: what each
    weight of the attention and dense MLP matrices takes where a checkpoint
    stores them quantized (QuantizationConfig.linear_weight_bytes; None: the
    dtype's size, as everything else)."""
    c = config
    hidden, hd = c.hidden_size, c.head_dim
    rows = cdiv(c.vocab_size, tp_size) * (1 if c.tie_word_embeddings else 2)
    q = c.num_attention_heads // tp_size * hd
    kv = num_local_kv_heads(c.num_key_value_heads, tp_size) * hd
    inter = c.intermediate_size // tp_size
    o_in = c.num_attention_heads * hd // tp_size
    attention_matrices = (q + 2 * kv) * hidden + hidden * o_in
    attention = 2 * hidden + (q + 2 * kv) * c.qkv_bias + hidden * c.o_bias  # 2 norms and the biases
    if c.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        attention += 2 * hd  # the q and k norms, one head wide
    mlp_matrices = 3 * inter * hidden  # gate and up, down
    dense_mlp = 2 * inter * c.mlp_bias + hidden * c.mlp_bias
    experts, width = c.num_experts, c.moe_intermediate_size
    if expert_parallel:
        experts //= tp_size
    else:
        width //= tp_size
    moe_mlp = c.num_experts * hidden + experts * 3 * width * hidden  # router, each expert's gate, up and down
    num_moe = 0
    if c.num_experts:
        from shoal.workers.model_executor.models.moe import is_moe_layer

        num_moe = sum(is_moe_layer(c, i) for i in range(c.num_hidden_layers))
    n, dense = c.num_hidden_layers, c.num_hidden_layers - num_moe
    params = rows * hidden + n * attention + dense * dense_mlp + num_moe * moe_mlp + hidden  # + the final norm
    matrices = n * attention_matrices + dense * mlp_matrices
    size = torch.empty(0, dtype=dtype).element_size()
    return params * size + math.ceil(matrices * (size if linear_bytes is None else linear_bytes))
