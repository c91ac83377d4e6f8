"""The Llama family (Llama, Mistral, Qwen2, SmolLM) over a flat batch.

The batch is one flat run of tokens from many sequences (no padding);
positions and the attention metadata say which token is where. q/k/v and
gate/up are fused into one matmul each, loaded from the separate
checkpoint tensors (see load_weights). Built inside a tensor-parallel group,
every layer holds this rank's slice (layers/linear.py) and logits reach
rank 0 only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shoal.workers.model_executor.layers.activation import SiluAndMul
from shoal.workers.model_executor.layers.attention import PagedAttention, get_forward_context
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.workers.model_executor.layers.weight_utils import default_weight_loader
from shoal.workers.model_executor.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused_ops: bool = False):
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.even(cfg.hidden_size, [n, n], cfg.mlp_bias)
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, cfg.mlp_bias)
        self.act_fn = SiluAndMul(fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, fused_ops: bool = False):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary)
        self.mlp = LlamaMLP(cfg, fused_ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's threading: returns the MLP output and the running sum
        before it, and each norm adds the pending output into the sum
        (fused on CUDA); the adds are the same, in the same order."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# checkpoint name piece -> (fused parameter piece, index of the shard)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, fused_ops: bool = False):
        """fused_ops: the small ops' fused Triton kernels off CUDA too (EngineArgs.fused_ops)."""
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, fused_ops)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, fused_ops) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one parameter, listed once
        self.cpu_kernels = None  # the compiled CPU kernels, when the model runner uses them
        self._decode_layers = None  # (what it was built over, cpu_kernels.DecodeLayers)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms' own: matrices may be stored narrower)."""
        return self.norm.weight.dtype

    def store_matrices_in(self, dtype: torch.dtype) -> None:
        """Stores the weight matrices (linear layers, embedding, LM head) in
        `dtype`; norms, activations and the KV cache keep the model's dtype.
        Each matmul widens the weights it reads (layers/cpu_linear.py)."""
        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                m.weight.data = m.weight.data.to(dtype)  # a tied head shares the embedding's: cast once

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor | None:
        """Logits (float32) only at `logits_indices` of the flat batch; on
        ranks other than 0 of a tensor-parallel group, None."""
        h, residual = self.embed_tokens(input_ids).to(self.dtype), None
        if self._decodes_only(h):
            group = get_forward_context().decodes[0]
            h, residual = self._bound_decode_layers()(
                h, positions, get_forward_context().slot_mapping, group.block_tables, group.context_lens
            )
        else:
            for layer in self.layers:
                h, residual = layer(positions, h, residual)
        out, _ = self.norm(h[logits_indices], residual[logits_indices])
        return self.lm_head(out)

    def _decodes_only(self, h: torch.Tensor) -> bool:
        """Whether the compiled CPU kernels can run every layer in one call:
        a step of one-token rows (one decode group) in float32, unsharded,
        with every matmul's inner size a multiple of the kernel's 16."""
        if self.cpu_kernels is None or h.dtype != torch.float32 or self.layers[0].mlp.down_proj.tp.size != 1:
            return False
        a, m = self.layers[0].self_attn, self.layers[0].mlp
        if any(layer.weight.shape[1] % 16 for layer in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)):
            return False
        ctx = get_forward_context()
        return (
            not ctx.prefills
            and ctx.triton is None
            and len(ctx.decodes) == 1
            and ctx.decodes[0].end - ctx.decodes[0].start == h.shape[0]
        )

    def unbind_kv_cache(self) -> None:
        """Drops the C++ layers' hold on the KV cache (the runner frees or replaces it)."""
        self._decode_layers = None

    def _bound_decode_layers(self):
        """The C++ layers bound to this model's weights and KV cache; built
        again when either is replaced (a new cache, weights cast on load)."""
        a0 = self.layers[0].self_attn
        key = (self.cpu_kernels, a0.attn.k_cache.data_ptr(), a0.qkv_proj.weight.data_ptr())
        if self._decode_layers is None or self._decode_layers[0] != key:
            none = torch.empty(0)
            weights, k_caches, v_caches = [], [], []
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                for w in (
                    layer.input_layernorm.weight,
                    a.qkv_proj.weight,
                    a.qkv_proj.bias,
                    a.o_proj.weight,
                    a.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    m.gate_up_proj.weight,
                    m.gate_up_proj.bias,
                    m.down_proj.weight,
                    m.down_proj.bias,
                ):
                    weights.append(none if w is None else w)
                k_caches.append(a.attn.k_cache)
                v_caches.append(a.attn.v_cache)
            layers = self.cpu_kernels.DecodeLayers(
                weights,
                k_caches,
                v_caches,
                a0.rotary.cos_cached,
                a0.rotary.sin_cached,
                a0.num_heads,
                a0.num_kv_heads,
                self.config.rms_norm_eps,
                a0.attn.scale,
            )
            self._decode_layers = (key, layers)
        return self._decode_layers[1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters,
        filling the fused q/k/v and gate/up from their parts."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied checkpoints sometimes carry a copy
            for piece, (fused, shard) in _STACKED.items():
                if f".{piece}." in name:
                    target = name.replace(piece, fused)
                    self._load(params[target], target, tensor, shard)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                self._load(params[name], name, tensor, None)
                loaded.add(name)
        expected = set()
        for name in params:
            if ".qkv_proj." in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    @staticmethod
    def _load(param: nn.Parameter, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Through the parameter's own loader, which takes this rank's slice."""
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
