"""Mixtral: Llama's attention (with the config's sliding window on every
layer, which the attention layer applies) and on every layer a sparse block
(`block_sparse_moe`) whose top-k router weights are always renormalised and
weight the experts in float32."""

from __future__ import annotations

from shoal.workers.model_executor.layers.fused_moe.layer import W1, W2, W3
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.llama import llama_weight_shapes
from shoal.workers.model_executor.models.moe import MoEDecoderLayer, MoEForCausalLM, moe_checkpoint_shapes


class MixtralDecoderLayer(MoEDecoderLayer):
    renormalize = True


class MixtralForCausalLM(MoEForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    moe_block = "block_sparse_moe"
    expert_names = {"w1": W1, "w3": W3, "w2": W2}

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig):
        yield from moe_checkpoint_shapes(
            cfg, llama_weight_shapes(cfg), "block_sparse_moe", MixtralForCausalLM.expert_names
        )
