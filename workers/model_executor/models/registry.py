"""Which class runs which checkpoint (vLLM's ModelRegistry, reduced).

A checkpoint names its architecture in config.json's `architectures` (or,
failing that, its `model_type`); a GGUF file in `general.architecture`
(models/gguf_config.py maps it to the same names). Each architecture is one
file under models/, imported only when a model of it is built.
"""

from __future__ import annotations

import importlib

# Hugging Face architecture -> (module under models/, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
}

# config.json's model_type -> architecture, for configs without `architectures`
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def resolve_architecture(hf_config: dict) -> str:
    """The architecture a config.json names, or a ValueError listing those shoal runs."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    model_type = hf_config.get("model_type", "llama")
    if not archs and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    named = ", ".join(archs) if archs else f"model_type {model_type!r}"
    raise ValueError(f"architecture {named} is not supported; shoal runs {', '.join(SUPPORTED_ARCHITECTURES)}")


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; shoal runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"shoal.workers.model_executor.models.{module}"), name)
