"""The architecture facts the engine needs, read from a Hugging Face
config.json (a GGUF file's metadata is first translated to one, see
gguf_config.py). What only one architecture reads (Gemma 3's local rope
base, Qwen3-MoE's dense layers) its model file takes from `hf_config`."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.workers.model_executor.models.registry import SUPPORTED_ARCHITECTURES, resolve_architecture

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]

# transformers' names for the MLP activations the layers implement
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Families whose `sliding_window` applies to every layer unless use_sliding_window says no
# (configs that list `layer_types` say per layer instead).
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3")


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
    sliding_window: int | None = None  # the window of the layers that have one
    architecture: str = "LlamaForCausalLM"  # the registry's key (models/registry.py)
    hidden_act: str = "silu"
    # Per layer: the number of most recent positions (itself included) a
    # query attends to, or None for full attention.
    layer_sliding_windows: list[int | None] = field(default_factory=list)
    partial_rotary_factor: float = 1.0
    # Mixture of experts (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    hf_config: dict = field(default_factory=dict)  # config.json as read, for architecture-only facts

    def __post_init__(self):
        if not self.layer_sliding_windows:
            self.layer_sliding_windows = [self.sliding_window] * self.num_hidden_layers

    def check_tp_size(self, tp_size: int, expert_parallel: bool = False) -> None:
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
        if self.num_experts and expert_parallel and self.num_experts % tp_size:
            raise ValueError(f"expert-parallel size {tp_size} does not divide the model's {self.num_experts} experts")
        if self.num_experts and not expert_parallel and self.moe_intermediate_size % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} does not divide the expert MLP width {self.moe_intermediate_size}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        architecture = resolve_architecture(d)
        model_type = d.get("model_type", "llama")
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(SUPPORTED_ACTIVATIONS)})")
        heads = d["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters;
        # a hybrid model keeps one per layer type, the global layers' here.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if isinstance(rope.get("full_attention"), dict):
            rope = dict(rope["full_attention"])
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = d.get("eos_token_id")
        attention_bias = bool(d.get("attention_bias", False))
        n_layers = d["num_hidden_layers"]
        window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("sliding_window_pattern"):  # older Gemma 3 configs: every Nth layer global
            pattern = d["sliding_window_pattern"]
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        if window and layer_types:
            windows = [window if t == "sliding_attention" else None for t in layer_types]
        elif window and d.get("use_sliding_window", model_type in _WINDOW_ON_EVERY_LAYER):
            windows = [window] * n_layers
        else:
            window, windows = None, [None] * n_layers
        if len(windows) != n_layers:
            raise ValueError(f"layer_types lists {len(windows)} layers for a model of {n_layers}")
        if not any(windows):
            window = None
        experts = d.get("num_experts") or d.get("num_local_experts") or 0
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or d.get("moe_intermediate_size") or 0,
            num_hidden_layers=n_layers,
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
            architecture=architecture,
            hidden_act=act,
            layer_sliding_windows=windows,
            partial_rotary_factor=float(partial),
            num_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=(d.get("moe_intermediate_size") or d.get("intermediate_size", 0)) if experts else 0,
            # Mixtral always renormalises its top-k weights; Qwen3-MoE says.
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            hf_config=dict(d),
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict, tensor_names: set[str]) -> ModelConfig:
        from shoal.workers.model_executor.models.gguf_config import hf_config_from_gguf

        return cls.from_hf_dict(hf_config_from_gguf(md, tensor_names))
