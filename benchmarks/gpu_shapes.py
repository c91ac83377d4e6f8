"""The model shapes `shoal bench gpu` runs with dummy weights: each a
Hugging Face config.json written to a temporary folder (shoal needs nothing
more for load_format "dummy", and transformers builds its peer from it)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class Shape:
    config: dict
    batch_sizes: tuple[int, ...]  # decode batches when --batch-sizes is not given
    offline: bool  # whether the offline workload runs on it
    max_model_len: int | None = None  # a cap for long-context shapes: the KV plan needs no 128k

    def write(self, root: str, name: str) -> str:
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**_LLAMA, **self.config}, f, indent=2)
        return path


SHAPES = {
    "smollm2-1.7b": Shape(
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=130000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
        (1, 16, 64, 256),
        offline=True,
    ),
    "llama-3.1-8b": Shape(
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        (1, 64),
        offline=False,
        max_model_len=4096,
    ),
    "qwen3-8b": Shape(
        dict(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
        (1, 64),
        offline=False,
        max_model_len=4096,
    ),
    # 128 experts, 8 active: about 3B of 30B parameters read per token.
    "qwen3-30b-a3b": Shape(
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
        (1, 64),
        offline=False,
        max_model_len=4096,
    ),
    # The MoE shape the CPU offline bench runs (bfloat16 weights): 32 experts, 4 active.
    "qwen3-moe-cpu": Shape(
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=384,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32000,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
        (1, 16),
        offline=True,
        max_model_len=4096,
    ),
    # For the CPU test of the whole command.
    "tiny": Shape(
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
        ),
        (1, 16, 64, 256),
        offline=True,
    ),
}


def shape_folders(names: list[str]) -> dict[str, tuple[Shape, str]]:
    """name -> (shape, its config folder); unknown names raise before anything runs."""
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    root = tempfile.mkdtemp(prefix="shoal-shapes-")
    return {n: (SHAPES[n], SHAPES[n].write(root, n)) for n in names}
