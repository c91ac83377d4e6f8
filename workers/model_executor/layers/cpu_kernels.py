"""The compiled CPU kernels (csrc/): decode attention straight from the
paged KV cache, and the few-row linear layer of a decode step.

Built once with torch's extension loader into ~/.cache/shoal/kernels/
shoal_cpu_kernels-<hash of sources and flags> under a lock that a killed
build cannot leave stuck (kernel_build.py; `make install` builds it ahead).
load() returns None where it cannot be built (no compiler, an unusual
platform): the pure-torch path then runs, and it stays the reference either
way. Another process's build outlasting SHOAL_KERNEL_BUILD_TIMEOUT is an
error naming the lock and its owner (KernelBuildTimeout): something is
wrong on that machine, and a start that quietly ran several times slower
would hide it. The engine loads it only under
EngineArgs.cpu_kernels (off: --no-cpu-kernels, or $SHOAL_CPU_KERNEL=0), when
the cpu_kernel attention backend is chosen; bind() is then the one place
the kernels reach the other layers.
"""

from __future__ import annotations

import logging
import os
import time

from torch import nn

from shoal.workers.model_executor.layers.custom_op import CustomOp
from shoal.workers.model_executor.layers.fused_moe.layer import FusedMoE
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.workers.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger(__name__)
# The layers that run on the kernels: each reads its `cpu_kernels` when called
# (None: the torch path). The linear layers and the LM head multiply through
# csrc/cpu_gemm.cpp; the CustomOps (RMSNorm, SiLU-and-multiply, rotary) call
# csrc/cpu_ops.cpp; FusedMoE multiplies each expert's rows through cpu_gemm.cpp.
KERNEL_USERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead, CustomOp, FusedMoE)
_kernel = None
_tried = False
_SOURCES = (
    "bindings.cpp",
    "paged_decode_cpu.cpp",
    "paged_prefill_cpu.cpp",
    "cpu_gemm.cpp",
    "cpu_ops.cpp",
    "cpu_decode_layers.cpp",
    "gguf_gemv.cpp",
    "gguf_kquants.cpp",
    "int8_gemm.cpp",
    "lora_cpu.cpp",
)


def load():
    global _kernel, _tried
    if _tried:
        return _kernel
    from shoal.workers.model_executor.layers.kernel_build import KernelBuildTimeout, load_extension

    try:
        t0 = time.perf_counter()
        csrc = os.path.join(os.path.dirname(__file__), "csrc")
        _kernel = load_extension(
            "shoal_cpu_kernels",
            [os.path.join(csrc, s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - t0)
    except KernelBuildTimeout:
        raise  # not remembered: a later call waits again
    except Exception as e:  # no compiler or ninja, an unusual platform
        logger.warning("CPU kernels unavailable (%s); using the torch path", e)
        _kernel = None
    _tried = True
    return _kernel


def bind(model: nn.Module, kernels) -> object | None:
    """Gives every layer of `model` that runs on the kernels (KERNEL_USERS)
    `kernels`, or None for the torch path; None too where the build lacks
    AVX2, which the matmul, the small ops and the one-call decode step are
    written in (only the decode attention kernel has a portable path).
    Called once by the model runner when it picks the attention backend.
    Returns what was bound."""
    from shoal.workers.model_executor.layers.quantization.gguf import GGUFLinearMethod, set_packed

    bound = kernels if getattr(kernels, "has_avx2", False) else None
    for module in model.modules():
        if isinstance(module, KERNEL_USERS):
            module.cpu_kernels = bound
        # GGUF blocks in the layout the kernels multiply (an embedding's rows are read from it too)
        if isinstance(module, (*KERNEL_USERS, VocabParallelEmbedding)) and isinstance(
            getattr(module, "quant_method", None), GGUFLinearMethod
        ):
            set_packed(module.weight, bound)
    return bound
