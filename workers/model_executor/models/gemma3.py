"""Gemma 3 (text): the Llama layout with Gemma's changes, following
transformers' modeling_gemma3 op for op so float32 runs match it.

- embeddings scaled by sqrt(hidden), the factor cast to the hidden dtype first;
- RMSNorms of the (1 + w) form, computed in float32 (layers/norm.py GemmaRMSNorm);
- a norm after attention and after the MLP too, each output added to the
  residual stream there (no pending residual carried between layers);
- QK-norm on each head of q and k before the rotary embedding;
- q.k scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- local layers attend to a sliding window with their own rotary base, global
  layers to everything with the global base and its scaling (layer_types);
- GeGLU MLP (gelu_tanh), tied embeddings, optional final logit softcapping.

Tensor parallel splits heads and the MLP as Llama's; the q/k norms are one
head wide and held whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.model_executor.layers.activation import GeluAndMul
from shoal.workers.model_executor.layers.attention import PagedAttention
from shoal.workers.model_executor.layers.norm import GemmaRMSNorm
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.llama import LlamaForCausalLM, LlamaMLP, llama_weight_shapes
from shoal.workers.model_executor.models.qwen3 import Qwen3Attention

# transformers' Gemma3TextConfig defaults, for configs that leave them out
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_DEFAULT_PATTERN = 6  # every 6th layer global


def layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention", as the config
    lists them or, for older configs, from sliding_window_pattern."""
    hf = cfg.hf_config
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern") or _DEFAULT_PATTERN
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(types)} layers for a model of {cfg.num_hidden_layers}")
    return list(types)


def rope_parameters(cfg: ModelConfig, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one layer type: transformers 5's nested
    rope_parameters, else the older rope_theta / rope_local_base_freq /
    rope_scaling (the scaling is the global layers')."""
    hf = cfg.hf_config
    nested = hf.get("rope_parameters") or {}
    if isinstance(nested.get(layer_type), dict):
        rope = dict(nested[layer_type])
    elif layer_type == "full_attention":
        rope = {"rope_theta": hf.get("rope_theta"), **(hf.get("rope_scaling") or {})}
    else:
        rope = {"rope_theta": hf.get("rope_local_base_freq")}
    theta = rope.pop("rope_theta", None) or _DEFAULT_THETA[layer_type]
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return float(theta), None
    return float(theta), rope


class Gemma3Attention(Qwen3Attention):
    """Qwen3's QK-norm attention with Gemma's norms, its own q.k scale and this layer's window."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        layer_idx: int = 0,
    ):
        super().__init__(cfg, rotary, quant_config, prefix, layer_idx)
        scale = float(cfg.hf_config.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        window = cfg.layer_sliding_windows[layer_idx]
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window=window)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3MLP(LlamaMLP):
    def __init__(
        self,
        cfg: ModelConfig,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__(cfg, fused_ops, quant_config, prefix)
        self.act_fn = GeluAndMul(fused_ops)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        layer_idx: int = 0,
    ):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, rotary, quant_config, f"{prefix}.self_attn", layer_idx)
        self.mlp = Gemma3MLP(cfg, fused_ops, quant_config, f"{prefix}.mlp")
        n, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(n, eps)
        self.post_attention_layernorm = GemmaRMSNorm(n, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(n, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(n, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(nn.Module):
    # The Llama family's loading and storing apply unchanged: the same
    # checkpoint names, the same fused q/k/v and gate/up, the same linear layers.
    load_weights = LlamaForCausalLM.load_weights
    _load = staticmethod(LlamaForCausalLM._load)
    store_matrices_in = LlamaForCausalLM.store_matrices_in
    attention_layers = LlamaForCausalLM.attention_layers
    dtype = LlamaForCausalLM.dtype

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        if cfg.hf_config.get("attn_logit_softcapping") is not None:
            raise ValueError("attention logit softcapping (Gemma 2) is not supported; Gemma 3 has none")
        if cfg.hf_config.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention (an embedding model) is not supported: shoal generates causally")
        self.config = cfg
        self.final_logit_softcapping = cfg.hf_config.get("final_logit_softcapping")
        types = layer_types(cfg)
        if [t == "sliding_attention" for t in types] != [w is not None for w in cfg.layer_sliding_windows]:
            raise ValueError(f"the config's sliding windows {cfg.layer_sliding_windows} disagree with its layer types")
        rotary = {
            t: RotaryEmbedding(cfg.head_dim, max_positions, *rope_parameters(cfg, t), fused_ops) for t in set(types)
        }
        self.rotary_local, self.rotary_global = rotary.get("sliding_attention"), rotary.get("full_attention")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, "model.embed_tokens")
        # A buffer, so model.to(dtype) rounds the factor to the hidden dtype as transformers does
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, rotary[types[i]], fused_ops, quant_config, f"model.layers.{i}", i)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config, "lm_head")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).to(self.dtype) * self.embed_scale

    def compute_logits(
        self, h: torch.Tensor, residual: torch.Tensor | None, logits_indices: torch.Tensor
    ) -> torch.Tensor | None:
        """The final norm and the LM head at `logits_indices`; `residual` is
        unused (each layer adds its outputs into h itself)."""
        logits = self.lm_head(self.norm(h[logits_indices]))
        cap = self.final_logit_softcapping
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor | None:
        h = self.get_input_embeddings(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.compute_logits(h, None, logits_indices)

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig):
        for name, shape in llama_weight_shapes(cfg):
            yield name, shape
            if name.endswith("post_attention_layernorm.weight"):
                prefix = name.removesuffix("post_attention_layernorm.weight")
                yield prefix + "pre_feedforward_layernorm.weight", shape
                yield prefix + "post_feedforward_layernorm.weight", shape
                for norm in ("q_norm", "k_norm"):
                    yield f"{prefix}self_attn.{norm}.weight", (cfg.head_dim,)
