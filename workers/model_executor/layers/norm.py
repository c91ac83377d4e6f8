"""RMSNorm, computed in float32 as transformers does, so float32 runs match
it bit for bit and half-precision runs match its rounding. On CUDA (or
with EngineArgs.fused_ops, see fused_ops) one Triton kernel does the residual
add and the norm; on the CPU, where platforms/cpu/bind.py gives the layer the
compiled kernels, one C++ call (platforms/cpu/csrc/cpu_ops.cpp)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.model_executor.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """forward(x) is norm(x); forward(x, residual) is (norm(residual + x),
    residual + x) as vLLM's, the fused kernels updating residual in place."""

    def __init__(self, hidden_size: int, eps: float, fused_ops: bool = False):
        super().__init__(fused_ops)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        from shoal.workers.model_executor.layers import fused_ops

        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps), residual

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.cpu_kernels is None or x.dtype != torch.float32 or x.dim() != 2:
            return self.forward_native(x, residual)
        if residual is None:
            return self.cpu_kernels.rms_norm(x, None, self.weight, self.eps)
        # In place, as the Triton kernel: residual is a sum this layer owns
        # (the first one is a copy of the embeddings, see LlamaDecoderLayer).
        return self.cpu_kernels.rms_norm(x, residual, self.weight, self.eps), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from one, and the scaling
    happens in float32 before the cast back (transformers' Gemma3RMSNorm;
    Llama's casts first, then scales)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)
