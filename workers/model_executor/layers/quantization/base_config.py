"""The seam where quantized weights plug in (vLLM's QuantizationConfig and
QuantizeMethodBase).

A layer asks its config for a method object once, when it is built. The
method registers the layer's weights, may repack them once the checkpoint is
read, and computes the layer's output on every call. A model file only hands
the config down with each layer's checkpoint name (its prefix), so a new
format (GGUF blocks, INT8, FP8) or a LoRA wrapper is a new config and method,
not a change to the models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


def set_weight_attrs(param: nn.Parameter, attrs: dict) -> None:
    """Attach what the loader reads from a parameter (its weight_loader, say)."""
    for key, value in attrs.items():
        setattr(param, key, value)


class QuantizeMethodBase(ABC):
    """How one layer holds its weights and computes with them."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, *weight_args, **extra_weight_attrs) -> None:
        """Register this rank's parameters on `layer`."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        """The layer's output, from the parameters create_weights made."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Once, after the checkpoint is loaded: repack or quantize; nothing by default."""


class LinearMethodBase(QuantizeMethodBase):
    """The method of a (parallel) linear layer."""

    @abstractmethod
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
        """Register this rank's weight: `output_partition_sizes` are the local
        rows of each fused part (q, k, v or gate, up); `input_size` and
        `output_size` the unsplit layer's; extra attributes (weight_loader) go
        on every parameter the loader fills."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + bias with this rank's W; a row-parallel layer reduces the result itself."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization: which method each layer gets."""

    @abstractmethod
    def get_name(self) -> str:
        """The name get_quantization_config knows it by."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        """Built from the checkpoint's quantization settings."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer`, named `prefix` as in the checkpoint
        ("model.layers.0.self_attn.qkv_proj"); None leaves it unquantized."""

    def linear_weight_bytes(self, dtype: torch.dtype) -> float | None:
        """The bytes a quantized linear layer holds per weight from the start
        of loading a model of `dtype` (a checkpoint stored quantized: scales
        included), for the check that the weights fit before they are read;
        None where they are read at the model's dtype first (quantized once loaded)."""
        return None
