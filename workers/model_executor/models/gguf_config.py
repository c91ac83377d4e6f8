"""A GGUF file's metadata as the Hugging Face config.json of the same model,
so one parser (config.py) reads both. llama.cpp's keys are
`<arch>.<fact>`; what GGUF leaves out (Gemma 3's layer pattern, say) is
filled in as llama.cpp itself hard-codes it. Each architecture's extras are
one function in `_EXTRAS`."""

from __future__ import annotations

from collections.abc import Callable

# general.architecture -> Hugging Face architecture and model_type
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}


def hf_config_from_gguf(md: dict, tensor_names: set[str]) -> dict:
    arch = md["general.architecture"]
    extras = _EXTRAS.get(arch)
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; shoal reads {', '.join(sorted(_ARCHITECTURES))}"
        )
    p = arch + "."
    heads = md[p + "attention.head_count"]
    hidden = md[p + "embedding_length"]
    rope: dict = {"rope_type": "default", "rope_theta": float(md.get(p + "rope.freq_base", 10000.0))}
    if md.get(p + "rope.scaling.type") in ("linear", "yarn"):
        rope |= {"rope_type": md[p + "rope.scaling.type"], "factor": md[p + "rope.scaling.factor"]}
        if p + "rope.scaling.original_context_length" in md:
            rope["original_max_position_embeddings"] = md[p + "rope.scaling.original_context_length"]
    eos = md.get("tokenizer.ggml.eos_token_id")
    architecture, model_type = _ARCHITECTURES[arch]
    d = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": md.get(p + "vocab_size") or len(md["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": md.get(p + "feed_forward_length", 0),
        "num_hidden_layers": md[p + "block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": md.get(p + "attention.head_count_kv", heads),
        "head_dim": md.get(p + "attention.key_length", hidden // heads),
        "rms_norm_eps": md[p + "attention.layer_norm_rms_epsilon"],
        "rope_parameters": rope,
        "max_position_embeddings": md.get(p + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    if arch == "llama":  # Llama's attention_bias covers all four projections
        d["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if p + "attention.sliding_window" in md:
        d["sliding_window"] = md[p + "attention.sliding_window"]
    if extras is not None:
        extras(md, tensor_names, d)
    return d


_EXTRAS: dict[str, Callable[[dict, set[str], dict], None]] = {}


def _gemma3(md: dict, tensor_names: set[str], d: dict) -> None:
    """What llama.cpp hard-codes for Gemma 3 (llama-model.cpp): every 6th
    layer global, the rest local with rotary base 10000 unscaled (the file's
    rope keys are the global layers'), and q.k scaled by head_dim ** -0.5,
    save the 27B (62 layers): (hidden / heads) ** -0.5. <end_of_turn> ends
    generation too, as the model's generation_config.json says."""
    n = d["num_hidden_layers"]
    d["hidden_activation"] = "gelu_pytorch_tanh"
    d["query_pre_attn_scalar"] = d["hidden_size"] // d["num_attention_heads"] if n == 62 else d["head_dim"]
    d["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    local = {"rope_type": "default", "rope_theta": 10000.0}
    d["rope_parameters"] = {"full_attention": d["rope_parameters"], "sliding_attention": local}
    tokens = md.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and d["eos_token_id"] is not None:
        d["eos_token_id"] = [d["eos_token_id"], tokens.index("<end_of_turn>")]


_EXTRAS["gemma3"] = _gemma3


def _moe(md: dict, tensor_names: set[str], d: dict) -> None:
    """Mixture of experts. llama.cpp writes Mixtral as a llama with
    expert_count > 0, its feed_forward_length the experts' width; Qwen3-MoE
    as qwen3moe, every layer sparse, the top-k weights renormalised
    (llama.cpp's build_moe_ffn norm_w), unless expert_weights_norm says no."""
    arch = md["general.architecture"]
    p = arch + "."
    experts = md.get(p + "expert_count", 0)
    if not experts:
        return
    d["num_experts"] = experts
    d["num_experts_per_tok"] = md[p + "expert_used_count"]
    d["moe_intermediate_size"] = md.get(p + "expert_feed_forward_length") or d["intermediate_size"]
    if arch == "llama":
        d["architectures"], d["model_type"] = ["MixtralForCausalLM"], "mixtral"
    else:
        d["norm_topk_prob"] = bool(md.get(p + "expert_weights_norm", True))


_EXTRAS["llama"] = _moe
_EXTRAS["qwen3moe"] = _moe


def _phi3(md: dict, tensor_names: set[str], d: dict) -> None:
    """Phi-3 / Phi-4 (llama.cpp's convert_hf_to_gguf Phi3MiniModel): the
    rotated dims as rope.dimension_count; LongRoPE as its original context,
    attention factor and two factor tensors, which models/phi3.py reads with
    the weights (the config cannot carry them); a window of 0 marks Phi-4's none."""
    p = "phi3."
    rotated = md.get(p + "rope.dimension_count")
    if rotated and rotated != d["head_dim"]:
        # the rotated dims are int(head_dim * factor): half a dim over, so rounding cannot lose one
        d["partial_rotary_factor"] = (rotated + 0.5) / d["head_dim"]
    if "rope_factors_long.weight" in tensor_names:
        orig = md[p + "rope.scaling.original_context_length"]
        d["original_max_position_embeddings"] = orig
        d["rope_parameters"] |= {
            "rope_type": "longrope",
            "original_max_position_embeddings": orig,
            "short_factor": None,
            "long_factor": None,
        }
        if p + "rope.scaling.attn_factor" in md:
            d["rope_parameters"]["attention_factor"] = float(md[p + "rope.scaling.attn_factor"])


_EXTRAS["phi3"] = _phi3
