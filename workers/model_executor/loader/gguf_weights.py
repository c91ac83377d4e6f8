"""A GGUF file's tensors under the Hugging Face names the models load
(llama.cpp renames them and reorders some; this undoes it). An architecture
whose tensors differ adds its names to `ARCH_NAMES` and, where llama.cpp
changed the values too, a function to `ARCH_TRANSFORMS`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from shoal.workers.model_executor.models.config import ModelConfig

# llama.cpp's per-block tensor names -> Hugging Face names
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Phi-3's LongRoPE factors (models/phi3.py takes them; other models skip rotary_emb tensors)
    "rope_factors_long": "model.rotary_emb.long_factor",
    "rope_factors_short": "model.rotary_emb.short_factor",
}
# general.architecture -> block names that differ from BLOCK_NAMES
ARCH_NAMES: dict[str, dict[str, str]] = {}
# general.architecture -> f(hf_name, array, cfg) -> [(hf_name, array)], for
# tensors llama.cpp changed (split, stacked or shifted) beyond renaming
ARCH_TRANSFORMS: dict[str, Callable[[str, np.ndarray, ModelConfig], list[tuple[str, np.ndarray]]]] = {}

# Gemma 3: a norm after attention and one before and after the MLP; llama.cpp's
# ffn_norm is the pre-MLP one. Its q/k are stored unpermuted (Gemma's rotary is
# Hugging Face's), and its converter adds one to every (1 + w) norm weight.
ARCH_NAMES["gemma3"] = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gemma_norms(name: str, w: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """Takes the one back off, in float32 as transformers' GGUF loader does."""
    return [(name, w - np.float32(1) if name.endswith("norm.weight") else w)]


ARCH_TRANSFORMS["gemma3"] = _gemma_norms

# Mixture of experts: the router, and each projection of every expert stacked
# in one [experts, rows, columns] tensor, split back into the per-expert
# matrices a Hub checkpoint holds. llama.cpp writes Mixtral as "llama".
ARCH_NAMES["qwen3moe"] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
ARCH_NAMES["llama"] = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.w1",
    "ffn_up_exps": "block_sparse_moe.experts.w3",
    "ffn_down_exps": "block_sparse_moe.experts.w2",
}


def _split_experts(name: str, w: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    if ".experts." not in name or w.ndim != 3:
        return [(name, w)]
    return [(name.replace(".experts.", f".experts.{e}."), w[e]) for e in range(w.shape[0])]


ARCH_TRANSFORMS["qwen3moe"] = _split_experts
ARCH_TRANSFORMS["llama"] = _split_experts

# Phi-3 keeps q/k/v and gate/up fused as its checkpoint does (rows gate then
# up, llama.cpp's swiglu halves); some files hold q/k/v apart (BLOCK_NAMES).
ARCH_NAMES["phi3"] = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (its rotary pairs adjacent dims; the
    Hugging Face layout pairs dim i with i + head_dim/2)."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@dataclass
class RawBlocks:
    """A block-quantized tensor as the file holds it: uint8 [rows, bytes a row]."""

    data: np.ndarray
    ggml_type: int
    cols: int


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors the model
    recomputes (rope_freqs) or has no use for."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        names = ARCH_NAMES.get(arch, {})
        piece = names.get(parts[2]) or BLOCK_NAMES.get(parts[2])
        if piece is None:
            raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")
        return f"model.layers.{parts[1]}.{piece}.{parts[-1]}"
    top = TOP_NAMES.get(parts[0])
    return None if top is None else f"{top}.{parts[-1]}"


def gguf_weights(
    g, cfg: ModelConfig, keep_blocks: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, np.ndarray | RawBlocks]]:
    """Every tensor of GGUFFile `g` as (Hugging Face name, float array);
    the block-quantized ones `keep_blocks` names come as their blocks
    (g.load_blocks, uint8 [rows, bytes a row]: the row order is undone on
    whole rows), as RawBlocks."""
    arch = g.metadata["general.architecture"]
    transform = ARCH_TRANSFORMS.get(arch)
    for gname in g.tensors:
        name = hf_name(gname, arch)
        if name is None:
            continue
        blocks = keep_blocks is not None and not g.is_float(gname) and keep_blocks(name)
        w = g.load_blocks(gname) if blocks else g.load(gname)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_key_value_heads)
        if blocks:  # transforms touch norms and experts only, never kept as blocks
            yield name, RawBlocks(w, g.tensors[gname].ggml_type, g.tensors[gname].shape[-1])
            continue
        pairs = transform(name, w, cfg) if transform is not None else [(name, w)]
        yield from pairs
