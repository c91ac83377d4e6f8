"""What a hybrid model's KV cache holds per sequence: one block table per
sequence (the engine's way: every layer keeps every block, and the kernels
apply the local layers' windows), against a table per layer group where a
local layer keeps only the blocks its window can reach.

`python -m shoal.benchmarks.kv_window_memory [--context 8192] [--block-size 16]`"""

from __future__ import annotations

import argparse

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.models.config import ModelConfig


def kv_bytes_per_sequence(
    cfg: ModelConfig, context_len: int, block_size: int, dtype_bytes: int, per_group_tables: bool
) -> int:
    """KV bytes one sequence of context_len tokens holds, over all layers,
    in whole blocks. per_group_tables: a windowed layer keeps only the last
    cdiv(W, block_size) + 1 blocks (its window's first key may sit anywhere
    in the oldest of them)."""
    blocks = cdiv(context_len, block_size)
    block_bytes = 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # keys and values
    total = 0
    for window in cfg.layer_sliding_windows:
        kept = min(blocks, cdiv(window, block_size) + 1) if window and per_group_tables else blocks
        total += kept * block_bytes
    return total


def gemma3(layers: int, kv_heads: int, head_dim: int, window: int) -> ModelConfig:
    """Gemma 3's attention shape: five local layers, then a global one."""
    return ModelConfig(
        model_type="gemma3_text",
        vocab_size=262_144,
        hidden_size=kv_heads * head_dim,  # not read here
        intermediate_size=0,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        max_position_embeddings=131_072,
        tie_word_embeddings=True,
        sliding_window=window,
        layer_sliding_windows=[None if i % 6 == 5 else window for i in range(layers)],
    )


SHAPES = {
    "Gemma 3 270M": gemma3(layers=18, kv_heads=1, head_dim=256, window=512),
    "Gemma 3 27B": gemma3(layers=62, kv_heads=16, head_dim=128, window=1024),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"KV bytes per sequence at {args.context} tokens, bfloat16, block size {args.block_size}")
    print(f"{'model':<14} {'local:global':>12} {'one table':>12} {'per group':>12} {'ratio':>6}")
    for name, cfg in SHAPES.items():
        local = sum(1 for w in cfg.layer_sliding_windows if w)
        one, grouped = (
            kv_bytes_per_sequence(cfg, args.context, args.block_size, 2, per_group_tables=g) for g in (False, True)
        )
        mix = f"{local}:{cfg.num_hidden_layers - local}"
        print(f"{name:<14} {mix:>12} {one / 2**20:>9.1f} MiB {grouped / 2**20:>8.1f} MiB {one / grouped:>5.2f}x")


if __name__ == "__main__":
    main()
