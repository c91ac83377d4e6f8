"""SiLU-and-multiply over the fused gate/up projection's output. On CUDA
(or with SHOAL_FUSED_OPS=1, see fused_ops) one Triton kernel; on the CPU
with the compiled kernels, one C++ call."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.cpu_kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x = [gate | up] along the last dim -> silu(gate) * up."""
        if x.is_cuda or os.environ.get("SHOAL_FUSED_OPS") == "1":
            from shoal.workers.model_executor.layers import fused_ops

            return fused_ops.silu_and_mul(x)
        if self.cpu_kernels is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.cpu_kernels.silu_and_mul(x)
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up
