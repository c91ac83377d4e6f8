"""Quantization configs by name (vLLM's get_quantization_config).

No config (None, "none"): every layer takes UnquantizedLinearMethod. A
format registers its QuantizationConfig here by module path, imported only
when asked for: options list the names without loading torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig

# name -> "module:class" of its config
_CONFIGS: dict[str, str] = {
    "gguf": "shoal.workers.model_executor.layers.quantization.gguf:GGUFConfig",
    "int8": "shoal.workers.model_executor.layers.quantization.int8:Int8Config",
    "fp8": "shoal.workers.model_executor.layers.quantization.fp8:Fp8Config",
    "compressed-tensors": "shoal.workers.model_executor.layers.quantization.compressed_tensors:CompressedTensorsConfig",
}
# Quantized at load from a float checkpoint (a checkpoint's own method is read from its config).
ONLINE_METHODS = ("int8", "fp8")
QUANTIZATION_METHODS = ("none", *_CONFIGS)


def get_quantization_config(name: str | None) -> type[QuantizationConfig] | None:
    """The config class for `name`; None (unquantized weights) for None or "none"."""
    if name is None or name == "none":
        return None
    if name not in _CONFIGS:
        raise ValueError(f"unknown quantization method {name!r}; shoal knows {', '.join(QUANTIZATION_METHODS)}")
    module, cls = _CONFIGS[name].split(":")
    return getattr(importlib.import_module(module), cls)
