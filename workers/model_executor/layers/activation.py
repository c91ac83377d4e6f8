"""SiLU-and-multiply over the fused gate/up projection's output. On CUDA
(or with EngineArgs.fused_ops, see fused_ops) one Triton kernel; on the CPU
with the compiled kernels, one C++ call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.workers.model_executor.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        from shoal.workers.model_executor.layers import fused_ops

        return fused_ops.silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.cpu_kernels.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(CustomOp):
    """x = [gate | up] along the last dim -> gelu_tanh(gate) * up (Gemma's
    GeGLU, transformers' gelu_pytorch_tanh). No kernel of its own: torch's
    everywhere."""

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
