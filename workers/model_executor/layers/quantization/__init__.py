"""Quantization configs by name (vLLM's get_quantization_config).

Only "none" so far: every layer takes UnquantizedLinearMethod. A format
adds its QuantizationConfig subclass to _CONFIGS. No torch here, so options
can list the names without loading the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig

# name -> config class; GGUF, INT8 and FP8 register theirs here
_CONFIGS: dict[str, type[QuantizationConfig]] = {}
QUANTIZATION_METHODS = ("none", *_CONFIGS)


def get_quantization_config(name: str | None) -> type[QuantizationConfig] | None:
    """The config class for `name`; None (unquantized weights) for None or "none"."""
    if name is None or name == "none":
        return None
    if name not in _CONFIGS:
        raise ValueError(f"unknown quantization method {name!r}; shoal knows {', '.join(QUANTIZATION_METHODS)}")
    return _CONFIGS[name]
