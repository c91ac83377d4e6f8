"""--quantization fp8: a float checkpoint quantized to e4m3 at load (vLLM's
online Fp8Config / Fp8LinearMethod).

Each linear layer loads its float weight as unquantized does, then keeps
it as float8_e4m3fn [N, K] with one float32 scale for the tensor (stored
once a row, so a per-channel checkpoint's scales fit the same parameter),
at 1 byte a weight. Each call quantizes the activations per token to e4m3
and multiplies with torch._scaled_mm on Hopper (triton_quant.fp8_w8a8_mm);
elsewhere the fp8 values are dequantized and multiplied in float32 (a
reference with the same numbers, not a fast path). The embedding and the
LM head stay in the model's dtype, as vLLM keeps them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from shoal.workers.model_executor.layers.quantization.online import LinearLayersConfig
from shoal.workers.model_executor.layers.quantization.unquantized import FloatWeightMethod


class Fp8LinearMethod(FloatWeightMethod):
    """A float weight while loading, e4m3 and its scale after."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from shoal.workers.model_executor.layers.quantization.triton_quant import quantize_weight_fp8

        # One scale for the whole tensor (the fused q, k, v share it), broadcast to a row each.
        q, s = quantize_weight_fp8(cast(torch.Tensor, layer.weight).data, per_channel=False)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(s.expand(q.shape[0]).contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # triton_quant imports Triton: only once a model computes in fp8 (tests set
        # TRITON_INTERPRET before the first import)
        from shoal.workers.model_executor.layers.quantization.triton_quant import fp8_w8a8_mm

        weight, scale = cast(torch.Tensor, layer.weight), cast(torch.Tensor, layer.weight_scale)
        return fp8_w8a8_mm(x, weight, scale, bias, out_dtype=x.dtype)


class Fp8Config(LinearLayersConfig):
    """Every linear layer in fp8; the embedding, the LM head and the norms
    in the model's dtype."""

    name = "fp8"
    method_cls = Fp8LinearMethod
