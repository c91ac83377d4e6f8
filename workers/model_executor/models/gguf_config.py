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
