"""Weights as the checkpoint has them: the method every layer gets when no
quantization config asks for another."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.workers.model_executor.layers.quantization.base_config import LinearMethodBase, set_weight_attrs
from shoal.workers.model_executor.platforms.cpu.matmul import linear


class FloatWeightMethod(LinearMethodBase):
    """One float weight [local rows, local inputs] that the layers' loaders
    fill: the unquantized method's storage, and what a method that
    quantizes at load (int8, fp8) starts from."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        shape = (sum(output_partition_sizes), input_size_per_partition)
        weight = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)


class UnquantizedLinearMethod(FloatWeightMethod):
    """One weight [local rows, local inputs] in the model's dtype (or the
    narrower one store_matrices_in casts it to), multiplied by
    platforms/cpu/matmul.py's linear: the compiled few-row kernel where
    platforms/cpu/bind.py has bound the layer's `cpu_kernels`, torch's F.linear otherwise."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, cast(torch.Tensor, layer.weight), bias, layer.cpu_kernels)


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
    """The vocabulary rows of the embedding and the LM head (the layer's
    loader zeroes the last rank's padding rows), looked up by `embedding`,
    multiplied by `apply` (the LM head)."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, cast(torch.Tensor, layer.weight))
