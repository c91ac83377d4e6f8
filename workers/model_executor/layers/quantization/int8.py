"""--quantization int8: INT8 W8A8 from a float checkpoint (vLLM's W8A8 int8).

Each linear layer's weight is loaded in float as the unquantized method's,
then quantized once per output channel, symmetric: w_scale = max|w_row| /
127, w = round(w / w_scale) in [-127, 127]. Every call quantizes x per
token the same way (dynamic, symmetric) and multiplies on integers:
y = (sum_k q_x q_w) * s_x * w_scale (+ bias). The embedding and the LM head
stay in float, as vLLM leaves them.

apply reads only `layer.weight` (int8 [N, K]) and `layer.weight_scale`
(float32 [N]), so a checkpoint stored in int8 (compressed-tensors) reuses it
with its own create_weights. Where it runs:
- the CPU with the compiled kernels bound: csrc/int8_gemm.cpp;
- CUDA: the Triton kernel (triton_quant.int8_w8a8_mm);
- otherwise torch, with the kernel's numerics (exact integer sums in float64).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from shoal.workers.model_executor.layers.quantization.online import LinearLayersConfig
from shoal.workers.model_executor.layers.quantization.unquantized import FloatWeightMethod

QMAX = 127  # symmetric: -128 is never used, so |q| <= 127 on both operands


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 [N]) of a float weight [N, K]: one symmetric scale a row."""
    w = w.float()
    scale = w.abs().amax(dim=1) / QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row: q = 0, scale 0
    q = torch.round(w / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 [M]) of float rows [M, K], as the kernels quantize
    activations: s = max|x_row| / 127 in float32, q = round-half-even(x / s)."""
    return quantize_per_channel(x)


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 [M, N] of x [M, K] against int8 weight [N, K]: the kernels'
    numerics in torch (integer sums are exact in float64 below 2^53)."""
    q, s = quantize_per_token(x)
    acc = (q.double() @ weight.double().T).float()  # the exact int32 sums
    y = (acc * s[:, None]).double() * weight_scale.double()  # fma(acc * s_x, w_scale, bias) up to one rounding
    if bias is not None:
        y = y + bias.double()
    return y.float()


class Int8LinearMethod(FloatWeightMethod):
    """A float weight while the checkpoint loads (the layer's weight_loader
    narrows it as usual), int8 [N, K] with float32 `weight_scale` [N] after.
    Tensor parallel: a column layer's rank holds whole output rows (their
    scales unchanged); a row layer's rank holds a slice of K and scales its
    own slice's rows, which differs from the unsplit layer's scale but is
    per-channel symmetric all the same (the partial sums are reduced in float)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_per_channel(cast(torch.Tensor, layer.weight).data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight, scale = cast(torch.Tensor, layer.weight), cast(torch.Tensor, layer.weight_scale)
        if weight.dtype != torch.int8:
            raise ValueError(f"int8 linear layer: weight is {weight.dtype}, not int8 (weights not processed?)")
        x2d = x.reshape(-1, x.shape[-1])
        kernels = getattr(layer, "cpu_kernels", None)
        if x.device.type == "cuda":
            from shoal.workers.model_executor.layers.quantization.triton_quant import int8_w8a8_mm

            y = int8_w8a8_mm(x2d, weight, scale, bias, out_dtype=x.dtype)
        elif (
            kernels is not None
            and hasattr(kernels, "int8_linear")
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32)
        ):
            y = kernels.int8_linear(x2d, weight, scale, None if bias is None else bias.contiguous())
        else:
            y = int8_linear_reference(x2d.float(), weight, scale, None if bias is None else bias.float())
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


class Int8Config(LinearLayersConfig):
    """Every linear layer in INT8 W8A8; the embedding and the LM head in float."""

    name = "int8"
    method_cls = Int8LinearMethod
