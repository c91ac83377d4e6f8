"""Gives the layers the compiled CPU kernels (kernels.py): the one place the
library reaches them. Each layer that runs on the kernels keeps it as its
`cpu_kernels` and reads it when called (None: the torch path)."""

from __future__ import annotations

from typing import cast

from torch import nn

from shoal.workers.model_executor.layers.custom_op import CustomOp
from shoal.workers.model_executor.layers.fused_moe.layer import FusedMoE
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.workers.model_executor.layers.quantization.gguf import GGUFLinearMethod
from shoal.workers.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.workers.model_executor.platforms.cpu.gguf_blocks import set_packed

# The layers that run on the kernels. The linear layers and the LM head
# multiply through csrc/cpu_gemm.cpp (or gguf_blocks.py's kernels); the
# CustomOps (RMSNorm, SiLU-and-multiply, rotary) call csrc/cpu_ops.cpp;
# FusedMoE multiplies each expert's rows through cpu_gemm.cpp.
KERNEL_USERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead, CustomOp, FusedMoE)


def bind(model: nn.Module, kernels) -> object | None:
    """Gives every layer of `model` that runs on the kernels (KERNEL_USERS)
    `kernels`, or None for the torch path; None too where the build lacks
    AVX2, which the matmul, the small ops and the one-call decode step are
    written in (only the decode attention kernel has a portable path).
    Called once by the model runner, with kernels.load() where its attention
    backend runs on them. Returns what was bound."""
    bound = kernels if getattr(kernels, "has_avx2", False) else None
    for module in model.modules():
        if isinstance(module, KERNEL_USERS):
            module.cpu_kernels = bound
        # GGUF blocks in the layout the kernels multiply (an embedding's rows are read from it too)
        if isinstance(module, (*KERNEL_USERS, VocabParallelEmbedding)) and isinstance(
            getattr(module, "quant_method", None), GGUFLinearMethod
        ):
            set_packed(cast(nn.Parameter, module.weight), bound)
    return bound
