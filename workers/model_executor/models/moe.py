"""What the mixture-of-experts models (Qwen3-MoE, Mixtral) share: the sparse
block (a router and the fused experts) in place of the dense MLP, the
checkpoint's per-expert matrices loaded into the stacked parameters, and the
load-balance counters.

A checkpoint holds each expert's three matrices under its own name
(`...experts.{e}.gate_proj.weight` in Qwen3-MoE, `...experts.{e}.w1.weight`
in Mixtral); transformers 5 keeps them stacked in memory
(`...experts.gate_up_proj` [E, 2I, H], `...experts.down_proj` [E, H, I]):
both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from shoal.workers.model_executor.layers.attention.kv_cache import load_kv_scale
from shoal.workers.model_executor.layers.fused_moe.layer import W1, W2, W3, FusedMoE
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear
from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.llama import (
    _STACKED,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """Whether a layer's MLP is the sparse block: Qwen3-MoE's every
    decoder_sparse_step-th layer not in mlp_only_layers; every layer of Mixtral."""
    step = cfg.hf_config.get("decoder_sparse_step") or 1
    dense = cfg.hf_config.get("mlp_only_layers") or ()
    return cfg.num_experts > 0 and layer_idx not in dense and (layer_idx + 1) % step == 0


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        renormalize: bool,
        cast_topk_weights: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        e = cfg.num_experts
        # The router, whole on every rank (one shard of all its rows): each rank routes every token.
        self.gate = ColumnParallelLinear(cfg.hidden_size, [(e, e, 0)], False, quant_config, f"{prefix}.gate")
        self.experts = FusedMoE(
            e,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            renormalize,
            quant_config,
            f"{prefix}.experts",
            cfg.hidden_act,
            cast_topk_weights,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (and its forward) with the sparse block as `mlp` where
    is_moe_layer says, the dense MLP elsewhere."""

    renormalize: bool | None = None  # None: the config's norm_topk_prob
    cast_topk_weights = False

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        layer_idx: int = 0,
    ):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build a dense MLP only to drop it
        self.self_attn = self.make_attention(cfg, rotary, fused_ops, quant_config, f"{prefix}.self_attn", layer_idx)
        if is_moe_layer(cfg, layer_idx):
            renormalize = cfg.norm_topk_prob if self.renormalize is None else self.renormalize
            self.mlp = SparseMoeBlock(cfg, renormalize, self.cast_topk_weights, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = LlamaMLP(cfg, fused_ops, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)

    @staticmethod
    def make_attention(cfg, rotary, fused_ops, quant_config, prefix, layer_idx) -> nn.Module:
        return LlamaAttention(cfg, rotary, quant_config, prefix, layer_idx)


class MoEForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = MoEDecoderLayer
    moe_block = "mlp"  # the sparse block's checkpoint name
    # the checkpoint's names of an expert's gate, up and down matrices
    expert_names = {"gate_proj": W1, "up_proj": W3, "down_proj": W2}

    def moe_layers(self) -> list[FusedMoE]:
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def expert_load(self) -> torch.Tensor:
        """(token, expert) picks since the last reset: int64 [sparse layers, experts]. Every rank routes every
        token, so rank 0's counts are the whole group's; each forward adds tokens x top_k per layer."""
        return torch.stack([m.expert_load() for m in self.moe_layers()])

    def rank_load(self) -> torch.Tensor:
        """Picks per expert-parallel rank: int64 [sparse layers, EP size] (EP size 1 without expert parallelism)."""
        return torch.stack([m.rank_load() for m in self.moe_layers()])

    def reset_expert_load(self) -> None:
        for m in self.moe_layers():
            m.reset_expert_load()

    def store_matrices_in(self, dtype: torch.dtype) -> None:
        super().store_matrices_in(dtype)
        for m in self.moe_layers():  # fused_experts' matmuls widen them as the linear layers' do
            m.w13_weight.data = m.w13_weight.data.to(dtype)
            m.w2_weight.data = m.w2_weight.data.to(dtype)

    def _target(self, name: str) -> tuple[str, object, list[str]]:
        """The parameter a checkpoint tensor (name without "model.") fills, its
        shard id, and the keys it accounts for in the completeness check."""
        if m := _EXPERT.match(name):
            layer, expert, piece = m.groups()
            which = self.expert_names.get(piece)
            if which is None:
                raise ValueError(f"checkpoint tensor {name!r} is no expert matrix this model has")
            target = f"layers.{layer}.mlp.experts.{'w2_weight' if which == W2 else 'w13_weight'}"
            shard = (int(expert), which)
            return target, shard, [f"{target}#{shard}"]
        if m := _STACKED_EXPERTS.match(name):
            layer, piece = m.groups()
            target = f"layers.{layer}.mlp.experts.{'w13_weight' if piece == 'gate_up_proj' else 'w2_weight'}"
            return target, None, list(self._expected(target))
        for piece, (fused, shard) in _STACKED.items():
            if f".{piece}." in name:
                target = name.replace(piece, fused)
                return target, shard, [f"{target}#{shard}"]
        return name, None, [name]

    def _expected(self, param_name: str) -> Iterator[str]:
        """The completeness check's keys of one parameter."""
        if param_name.endswith(".w13_weight"):
            yield from (f"{param_name}#{(e, w)}" for e in range(self.config.num_experts) for w in (W1, W3))
        elif param_name.endswith(".w2_weight"):
            yield from (f"{param_name}#{(e, W2)}" for e in range(self.config.num_experts))
        elif ".qkv_proj." in param_name:
            yield from (f"{param_name}#{i}" for i in range(3))
        elif ".gate_up_proj." in param_name:
            yield from (f"{param_name}#{i}" for i in range(2))
        else:
            yield param_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LlamaForCausalLM's, with each expert matrix (every expert's, also
        those another expert-parallel rank keeps) through FusedMoE's loader."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        block = f".{self.moe_block}."
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(block, ".mlp.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied checkpoints sometimes carry a copy
            if load_kv_scale(self, name, tensor):
                continue
            target, shard, keys = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            self._load(params[target], target, tensor, shard)
            loaded.update(keys)
        expected = {k for name in params for k in self._expected(name)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def moe_checkpoint_shapes(
    cfg: ModelConfig, dense_shapes: Iterable[tuple[str, tuple[int, ...]]], block: str, names: dict[str, str]
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A MoE checkpoint's tensors (per-expert names, as on the Hub): the dense
    model's, less the MLP of each sparse layer, plus its router and experts."""
    hidden, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    sparse = {f"model.layers.{i}.mlp." for i in range(cfg.num_hidden_layers) if is_moe_layer(cfg, i)}
    piece = {which: name for name, which in names.items()}
    for name, shape in dense_shapes:
        if not any(name.startswith(s) for s in sparse):
            yield name, shape
    for layer in sorted(int(p.split(".")[2]) for p in sparse):
        p = f"model.layers.{layer}.{block}."
        yield p + "gate.weight", (e, hidden)
        for expert in range(e):
            yield f"{p}experts.{expert}.{piece[W1]}.weight", (inter, hidden)
            yield f"{p}experts.{expert}.{piece[W3]}.weight", (inter, hidden)
            yield f"{p}experts.{expert}.{piece[W2]}.weight", (hidden, inter)
