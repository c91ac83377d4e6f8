"""The architecture facts the engine needs, read from a Hugging Face
config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None

    def check_tp_size(self, tp_size: int) -> None:
        """Refuse, with the reason, a tensor-parallel size that cannot split this model."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
        if tp_size == 1:
            return
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {heads} attention heads")
        if kv % tp_size and tp_size % kv:
            raise ValueError(
                f"tensor_parallel_size {tp_size} neither divides the model's {kv} KV heads nor is a multiple of them"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the MLP width {self.intermediate_size}")

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported; shoal runs {SUPPORTED_ARCHITECTURES}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (silu only)")
        heads = d["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = d.get("eos_token_id")
        attention_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's
            # attention_bias covers all four projections.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            sliding_window=window,
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict, tensor_names: set[str]) -> ModelConfig:
        arch = md["general.architecture"]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported; shoal runs {SUPPORTED_ARCHITECTURES}")
        p = arch + "."
        heads = md[p + "attention.head_count"]
        hidden = md[p + "embedding_length"]
        scaling = None
        if md.get(p + "rope.scaling.type") in ("linear", "yarn"):
            scaling = {"rope_type": md[p + "rope.scaling.type"], "factor": md[p + "rope.scaling.factor"]}
            if p + "rope.scaling.original_context_length" in md:
                scaling["original_max_position_embeddings"] = md[p + "rope.scaling.original_context_length"]
        vocab = md.get(p + "vocab_size") or len(md["tokenizer.ggml.tokens"])
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(
            model_type=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=md[p + "feed_forward_length"],
            num_hidden_layers=md[p + "block_count"],
            num_attention_heads=heads,
            num_key_value_heads=md.get(p + "attention.head_count_kv", heads),
            head_dim=md.get(p + "attention.key_length", hidden // heads),
            rms_norm_eps=md[p + "attention.layer_norm_rms_epsilon"],
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=md.get(p + "context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
        )
