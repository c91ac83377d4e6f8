"""What a model offers a platform's one-call decode step
(platforms/cpu/decode_step.py): its decoder layers' kinds and the modules
that hold their weights, KV cache and rotary tables. The step reads the
plan, never a model's attributes, so a model reshaped inside keeps the fast
path as long as its plan says the same.

A model offers one by `decode_plan()`. A model without one, or whose plan
the step cannot compute (another kind of layer, weights in a method it
does not read), runs every step through its own forward, and the engine
says why when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.workers.model_executor.layers.attention import PagedAttention
from shoal.workers.model_executor.layers.linear import LinearBase
from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

# Llama's pre-norm layer: h += o(attention(rotary(qkv(rms_norm(h))))), then
# h += down(silu(gate) * up) of gate_up(rms_norm(h)); rotary over whole heads,
# every linear with an optional bias.
LLAMA = "llama"


@dataclass(frozen=True, slots=True)
class DecoderLayerPlan:
    kind: str  # what the layer computes of its parts (LLAMA)
    input_norm: RMSNorm
    qkv_proj: LinearBase  # q, k and v fused (its quant_method holds the weight as it is stored)
    o_proj: LinearBase
    post_attention_norm: RMSNorm
    gate_up_proj: LinearBase  # gate and up fused
    down_proj: LinearBase
    attn: PagedAttention  # its KV cache, this rank's heads, scale and sliding window
    rotary: RotaryEmbedding  # its cos and sin tables


@dataclass(frozen=True, slots=True)
class DecodePlan:
    layers: tuple[DecoderLayerPlan, ...]
    embed_tokens: VocabParallelEmbedding
    norm: RMSNorm  # the final norm, before the LM head
    lm_head: ParallelLMHead
    rms_norm_eps: float  # every norm's
