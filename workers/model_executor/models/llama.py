"""The Llama family (Llama, Mistral, Qwen2, SmolLM) over a flat batch.

The batch is one flat run of tokens from many sequences (no padding);
positions and the attention metadata say which token is where. q/k/v and
gate/up are fused into one matmul each, loaded from the separate
checkpoint tensors (see load_weights). Built inside a tensor-parallel group,
every layer holds this rank's slice (layers/linear.py) and logits reach
rank 0 only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from shoal.workers.model_executor.layers.activation import SiluAndMul
from shoal.workers.model_executor.layers.attention import PagedAttention
from shoal.workers.model_executor.layers.attention.kv_cache import load_kv_scale
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.workers.model_executor.layers.weight_utils import default_weight_loader
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.decode_plan import LLAMA, DecodePlan, DecoderLayerPlan


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        layer_idx: int = 0,
    ):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.qkv_bias,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, quant_config, f"{prefix}.o_proj"
        )
        self.rotary = rotary
        window = cfg.layer_sliding_windows[layer_idx]
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.even(
            cfg.hidden_size, [n, n], cfg.mlp_bias, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, cfg.mlp_bias, quant_config, f"{prefix}.down_proj")
        self.act_fn = SiluAndMul(fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
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
        self.self_attn = LlamaAttention(cfg, rotary, quant_config, f"{prefix}.self_attn", layer_idx)
        self.mlp = LlamaMLP(cfg, fused_ops, quant_config, f"{prefix}.mlp")
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

    def decode_plan(self) -> DecoderLayerPlan:
        """This layer's parts, as a one-call decode step reads them (models/decode_plan.py)."""
        a, m = self.self_attn, self.mlp
        return DecoderLayerPlan(
            LLAMA,
            self.input_layernorm,
            a.qkv_proj,
            a.o_proj,
            self.post_attention_layernorm,
            m.gate_up_proj,
            m.down_proj,
            a.attn,
            a.rotary,
        )


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


# checkpoint name piece -> (fused parameter piece, index of the shard)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls = LlamaDecoderLayer  # a family that changes only its layers (Qwen3) swaps this

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        fused_ops: bool = False,
        quant_config: QuantizationConfig | None = None,
    ):
        """fused_ops: the small ops' fused Triton kernels off CUDA too (EngineArgs.fused_ops);
        quant_config: each layer's weight method by checkpoint name (None: unquantized)."""
        super().__init__()
        self.config = cfg
        rotary = self.make_rotary(cfg, max_positions, fused_ops)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config, "model.embed_tokens")
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, rotary, fused_ops, quant_config, f"model.layers.{i}", i)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config, "lm_head")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one parameter, listed once

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The checkpoint's tensor names and full shapes (for --load-format dummy)."""
        return llama_weight_shapes(cfg)

    def make_rotary(self, cfg: ModelConfig, max_positions: int, fused_ops: bool) -> RotaryEmbedding:
        """The rotary embedding every layer shares (a family with its own scaling overrides this)."""
        return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, fused_ops)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms' own: matrices may be stored narrower)."""
        return self.norm.weight.dtype

    def store_matrices_in(self, dtype: torch.dtype) -> None:
        """Stores the weight matrices (linear layers, embedding, LM head) in
        `dtype`; norms, activations and the KV cache keep the model's dtype.
        Each matmul widens the weights it reads (platforms/cpu/matmul.py)."""
        for m in self.modules():
            # A quantized method's weights are its own (GGUF blocks): only unquantized ones narrow.
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and isinstance(
                m.quant_method, UnquantizedLinearMethod
            ):
                m.weight.data = m.weight.data.to(dtype)  # a tied head shares the embedding's: cast once

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def decode_plan(self) -> DecodePlan | None:
        """The model as a platform's one-call decode step reads it
        (models/decode_plan.py). Llama's own only: a family built on this
        class changes what its layers compute (Qwen3's QK-norm, a mixture's
        experts, Phi-3's partial and LongRoPE rotary) and offers none until
        it plans its own."""
        if type(self) is not LlamaForCausalLM:
            return None
        layers = tuple(layer.decode_plan() for layer in self.layers)
        return DecodePlan(layers, self.embed_tokens, self.norm, self.lm_head, self.config.rms_norm_eps)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).to(self.dtype)

    def compute_logits(
        self, h: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor | None:
        """The final norm (adding the last layer's pending output into the
        sum) and the LM head, at `logits_indices` only."""
        out, _ = self.norm(h[logits_indices], residual[logits_indices])
        return self.lm_head(out)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor | None:
        """Logits (float32) only at `logits_indices` of the flat batch; on
        ranks other than 0 of a tensor-parallel group, None."""
        h, residual = self.get_input_embeddings(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.compute_logits(h, residual, logits_indices)

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
            if load_kv_scale(self, name, tensor):
                continue
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
