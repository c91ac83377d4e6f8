"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama layout with q/k/v and
gate/up fused in the checkpoint, partial rotary (Phi-4-mini rotates 3/4 of
each head), LongRoPE for the 128k-context models and a sliding window on
every layer where the config sets one (ModelConfig reads it).

The fused checkpoint tensors are cut into their q/k/v (gate/up) parts and
each part goes through the layer's loader with its shard id, so a
tensor-parallel rank takes its heads of each part, as from a Llama
checkpoint. A GGUF file's LongRoPE factors are tensors: they arrive with the
weights and the rotary tables are recomputed then. Which of LongRoPE's two
factor sets a sequence gets is fixed per engine by max_model_len
(layers/rotary.py says why and where that differs from transformers).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.llama import LlamaForCausalLM

# transformers' Phi3Config default for original_max_position_embeddings
_DEFAULT_ORIGINAL_CONTEXT = 4096
# where load_weights finds a GGUF file's LongRoPE factors (gguf_weights.TOP_NAMES)
FACTOR_TENSORS = {
    "model.rotary_emb.short_factor.weight": "short_factor",
    "model.rotary_emb.long_factor.weight": "long_factor",
}


def phi3_rope_scaling(cfg: ModelConfig) -> dict | None:
    """The rope scaling as transformers' Phi3Config reads it: the old names
    "su" and "yarn" mean longrope there; the top-level original_max_position_embeddings
    wins over the one in the rope parameters; factor defaults to
    max_position_embeddings / original."""
    if not cfg.rope_scaling:
        return None
    s = dict(cfg.rope_scaling)
    kind = s.get("rope_type") or s.pop("type", None) or "default"
    if kind in ("su", "yarn", "longrope"):
        top = cfg.hf_config.get("original_max_position_embeddings")
        orig = int(top or s.get("original_max_position_embeddings") or _DEFAULT_ORIGINAL_CONTEXT)
        s.update(rope_type="longrope", original_max_position_embeddings=orig)
        if s.get("factor") is None:
            s["factor"] = cfg.max_position_embeddings / orig
    else:
        s["rope_type"] = kind
    return s


class Phi3ForCausalLM(LlamaForCausalLM):
    def make_rotary(self, cfg: ModelConfig, max_positions: int, fused_ops: bool) -> RotaryEmbedding:
        self.rope_scaling = phi3_rope_scaling(cfg)
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        return RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, self.rope_scaling, fused_ops, rotary_dim=rotary_dim
        )

    @property
    def rotary(self) -> RotaryEmbedding:
        return self.layers[0].self_attn.rotary

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama loader over the checkpoint with its fused tensors cut
        into the parts that loader takes (a GGUF file may also hold them
        apart); then any LongRoPE factors that came as tensors."""
        factors: dict[str, torch.Tensor] = {}
        super().load_weights(self._split_fused(weights, factors))
        s = self.rope_scaling
        if s is not None and s["rope_type"] == "longrope" and s.get("short_factor") is None:
            missing = sorted(set(FACTOR_TENSORS.values()) - set(factors))
            if missing:
                raise ValueError(f"longrope without its factors: neither the config nor the checkpoint has {missing}")
            self.rope_scaling = {**s, **{k: t.float().flatten().tolist() for k, t in factors.items()}}
            self.rotary.set_scaling(self.rope_scaling)

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]], factors: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        parts = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
            "gate_up_proj": (("gate_proj", "up_proj"), [cfg.intermediate_size] * 2),
        }
        for name, tensor in weights:
            if name in FACTOR_TENSORS:
                factors[FACTOR_TENSORS[name]] = tensor
                continue
            fused = next((f for f in parts if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            pieces, sizes = parts[fused]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} has not {sum(sizes)} rows")
            for piece, part in zip(pieces, tensor.split(sizes, dim=0)):
                yield name.replace(fused, piece), part

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig):
        """The Phi-3 checkpoint's names (fused q/k/v and gate/up) and full shapes."""
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        yield "model.embed_tokens.weight", (cfg.vocab_size, hidden)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (hidden,)
            yield p + "post_attention_layernorm.weight", (hidden,)
            yield p + "self_attn.qkv_proj.weight", (q + 2 * kv, hidden)
            yield p + "self_attn.o_proj.weight", (hidden, q)
            yield p + "mlp.gate_up_proj.weight", (2 * inter, hidden)
            yield p + "mlp.down_proj.weight", (hidden, inter)
        yield "model.norm.weight", (hidden,)
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", (cfg.vocab_size, hidden)
        s = phi3_rope_scaling(cfg)
        if s is not None and s["rope_type"] == "longrope" and s.get("short_factor") is None:
            for name in FACTOR_TENSORS:  # a GGUF file's config: the factors are tensors
                yield name, (int(cfg.head_dim * cfg.partial_rotary_factor) // 2,)
