"""Picks the engine's attention backend once, at start (vLLM's
get_attn_backend): the only place that looks at the backend's name."""

from __future__ import annotations

import torch

from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionBackend
from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import REQUIREMENTS, CPUKernelBackend
from shoal.workers.model_executor.layers.attention.backends.flash_attn import FlashAttentionBackend
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import TorchSDPABackend
from shoal.workers.model_executor.layers.attention.backends.triton_attn import TritonAttentionBackend
from shoal.workers.model_executor.layers.attention.kv_cache import FP8_DTYPE
from shoal.workers.model_executor.platforms.cpu.kernels import load as load_cpu_kernels

BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (TorchSDPABackend, CPUKernelBackend, TritonAttentionBackend, FlashAttentionBackend)
}


def get_attn_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    use_cpu_kernels: bool = True,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend `name` (EngineArgs.attention_backend) names, validated for
    this engine; raises, saying why, where it cannot run. use_cpu_kernels:
    EngineArgs.cpu_kernels (off, cpu_kernel is refused and auto never picks it).
    kv_cache_dtype: the cache's element dtype (None: dtype); auto picks a
    backend that reads an fp8 cache, and one named that cannot is refused."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"attention_backend must be auto, torch, cpu_kernel, triton or flash_attn; got {name!r}")
    fp8 = kv_cache_dtype == FP8_DTYPE
    if name == "auto":
        name = _auto(device, dtype, use_cpu_kernels and not fp8)
    if name == "cpu_kernel" and not use_cpu_kernels:
        raise RuntimeError(REQUIREMENTS)
    if fp8 and not BACKENDS[name].supports_fp8_kv_cache:
        fp8_backends = ", ".join(n for n, b in BACKENDS.items() if b.supports_fp8_kv_cache)
        raise ValueError(
            f"attention_backend={name!r} cannot read an fp8 KV cache (kv_cache_dtype='fp8'); "
            f"use attention_backend auto or one of {fp8_backends}, or kv_cache_dtype='auto'"
        )
    backend = BACKENDS[name]()
    backend.validate(device, dtype, block_size)
    return backend


def _auto(device: torch.device, dtype: torch.dtype, use_cpu_kernels: bool) -> str:
    # On CUDA, Triton: a varlen kernel reads the whole step from one set of
    # flat tensors, where torch's masked SDPA builds a new cuDNN plan for
    # every new shape. On the CPU in float32, decodes read the paged cache
    # and multiply their few rows by the weights through the compiled
    # kernels when they build; torch is the fallback and the reference (and
    # the CPU's backend for an fp8 cache, which the compiled kernel cannot read).
    if device.type == "cuda":
        return "triton"
    if use_cpu_kernels and device.type == "cpu" and dtype == torch.float32 and load_cpu_kernels() is not None:
        return "cpu_kernel"
    return "torch"
