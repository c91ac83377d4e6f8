"""Random weights made from a model's config alone (vLLM's --load-format
dummy), so a benchmark of an 8B or 70B shape needs no checkpoint.

They come as a checkpoint would: full-shaped tensors under Hugging Face
names, one at a time, through the model's load_weights. Each tensor parallel
rank thus draws the same full tensors (one fixed seed, one fixed order) and
keeps its own slice of one consistent model, and load_weights checks that
every parameter got a tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shoal.workers.model_executor.models.config import ModelConfig

SEED = 1234  # vLLM's dummy loader's
LOW, HIGH = -1e-3, 1e-3  # vLLM's range: small enough that activations stay finite


def dummy_weight_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Hugging Face checkpoint's tensor names and full shapes: the model
    class's `checkpoint_shapes` where it has one, else the Llama family's."""
    from shoal.workers.model_executor.models.registry import get_model_class

    own = getattr(get_model_class(cfg.architecture), "checkpoint_shapes", None)
    return own(cfg) if own is not None else llama_weight_shapes(cfg)


def llama_weight_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Llama family's checkpoint: tensor names and full shapes."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, hidden)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{p}self_attn.{name}.weight", (rows, hidden)
            if cfg.qkv_bias:
                yield f"{p}self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (hidden, q)
        if cfg.o_bias:
            yield p + "self_attn.o_proj.bias", (hidden,)
        for name, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            yield f"{p}mlp.{name}.weight", shape
            if cfg.mlp_bias:
                yield f"{p}mlp.{name}.bias", shape[:1]
    yield "model.norm.weight", (hidden,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, hidden)


def dummy_weights(cfg: ModelConfig, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Norms are ones (as a fresh model's), everything else uniform in
    [LOW, HIGH]. Drawn on `device`: on a GPU a 70B shape takes seconds, on
    the CPU minutes. Ranks on one device type draw the same numbers."""
    gen = torch.Generator(device).manual_seed(SEED)
    for name, shape in dummy_weight_shapes(cfg):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.empty(shape, device=device).uniform_(LOW, HIGH, generator=gen)
