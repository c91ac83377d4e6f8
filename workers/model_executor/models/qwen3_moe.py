"""Qwen3-MoE: Qwen3's attention (QK-norm) with a sparse block of routed
experts (no shared expert) on every decoder_sparse_step-th layer not listed
in mlp_only_layers, a dense MLP of intermediate_size on the others. The
router's top-k weights are renormalised when norm_topk_prob says, then
rounded to the model dtype (transformers' numerics)."""

from __future__ import annotations

from shoal.workers.model_executor.layers.fused_moe.layer import W1, W2, W3
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.moe import MoEDecoderLayer, MoEForCausalLM, moe_checkpoint_shapes
from shoal.workers.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    cast_topk_weights = True

    @staticmethod
    def make_attention(cfg, rotary, fused_ops, quant_config, prefix, layer_idx):
        return Qwen3Attention(cfg, rotary, quant_config, prefix, layer_idx, fused_ops)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer
    moe_block = "mlp"
    expert_names = {"gate_proj": W1, "up_proj": W3, "down_proj": W2}

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig):
        yield from moe_checkpoint_shapes(
            cfg, Qwen3ForCausalLM.checkpoint_shapes(cfg), "mlp", Qwen3MoeForCausalLM.expert_names
        )
