"""Shared fixtures: the tiny random models of tiny_models.py, made once per session."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Grouped-query attention, untied embeddings, no bias."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_model) -> dict[str, str]:
    """The variants the token-exact test walks through."""
    return {
        "llama-gqa-untied": tiny_model,
        "llama-tied-bias": make_tiny_model(
            str(tmp_path_factory.mktemp("tiny-tied-bias")), tie_word_embeddings=True, attention_bias=True
        ),
        "qwen2-bias-mha": make_tiny_model(
            str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2", num_key_value_heads=4, tie_word_embeddings=True
        ),
        "mistral": make_tiny_model(str(tmp_path_factory.mktemp("tiny-mistral")), "mistral", head_dim=32),
        "llama3-rope": make_tiny_model(
            str(tmp_path_factory.mktemp("tiny-llama3")),
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    }


@pytest.fixture(scope="session")
def kernels():
    """The compiled CPU kernels, for the tests of the one-call decode step (which needs AVX2)."""
    from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

    k = cpu_kernels.load()
    if k is None or not k.has_avx2:
        pytest.skip("the one-call decode step needs the compiled kernels with AVX2")
    return k
