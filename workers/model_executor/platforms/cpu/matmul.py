"""The matmul of the unquantized linear method (quantization/unquantized.py):
every linear layer and the LM head, until a quantization config gives them another.

A decode step multiplies a few rows by each weight matrix: a read of the
weights, where torch's BLAS (MKL) reaches half the read bandwidth at one
row and a fifth at 2..16. The compiled kernel (csrc/cpu_gemm.cpp) takes
those steps on the CPU in float32; long prompt chunks stay with the BLAS,
whose cache tiling is built for them. A layer whose weights are stored in
bfloat16 under a float32 model (--weight-dtype bfloat16) computes in
float32 either way. A bfloat16 model (where the CPU has bfloat16 dot
products: precision.py) takes F.linear in bfloat16, which torch runs
through oneDNN with float32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many rows the kernel matched or beat MKL's sgemm on every
# SmolLM2 layer shape on a 2-core AVX2 machine (2026-12-07: 156-164 GFLOP/s
# against 115-123 at 32 rows, 160-172 against 156-171 at 256; 3x at 4).
MAX_KERNEL_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel) -> torch.Tensor:
    """x @ weight.T + bias, in x's dtype; `kernel` is the compiled CPU module or None."""
    if (
        kernel is not None
        and x.dim() == 2
        and x.shape[0] <= MAX_KERNEL_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.shape[1] % 16 == 0
    ):
        return kernel.small_m_linear(x, weight, bias)
    if weight.dtype != x.dtype:  # bfloat16-stored weights in a float32 model: widen for the BLAS
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)
