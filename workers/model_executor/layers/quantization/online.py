"""Quantization at load (vLLM's "online" quantization): a float
checkpoint's linear layers are read as float and quantized once they are
loaded (--quantization int8, fp8)."""

from __future__ import annotations

from torch import nn

from shoal.workers.model_executor.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)


class LinearLayersConfig(QuantizationConfig):
    """A config quantizing every linear layer at load and nothing else (the
    embedding, the LM head and the norms stay in the model's dtype, as vLLM
    keeps them): a subclass names itself and its method."""

    name: str
    method_cls: type[LinearMethodBase]

    def get_name(self) -> str:
        return self.name

    @classmethod
    def from_config(cls, config: dict) -> LinearLayersConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from shoal.workers.model_executor.layers.linear import LinearBase

        return self.method_cls() if isinstance(layer, LinearBase) else None
