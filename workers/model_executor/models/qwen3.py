"""Qwen3 (dense): the Llama layout with an RMSNorm over each head of q and
k before the rotary embedding (QK-norm), and no q/k/v bias.

The norms' weights are one head wide and shared by every head, so a
tensor-parallel rank holds them whole whatever heads it has.
"""

from __future__ import annotations

import torch

from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    llama_weight_shapes,
)


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        layer_idx: int = 0,
        fused_ops: bool = False,
    ):
        super().__init__(cfg, rotary, quant_config, prefix, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, fused_ops)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, fused_ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # One row per head, so the norms take the 2-D fast paths.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        layer_idx: int = 0,
    ):
        super().__init__(cfg, rotary, fused_ops, quant_config, prefix, layer_idx)
        self.self_attn = Qwen3Attention(cfg, rotary, quant_config, f"{prefix}.self_attn", layer_idx, fused_ops)


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig):
        yield from llama_weight_shapes(cfg)
        for i in range(cfg.num_hidden_layers):
            for norm in ("q_norm", "k_norm"):
                yield f"model.layers.{i}.self_attn.{norm}.weight", (cfg.head_dim,)
