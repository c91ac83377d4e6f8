"""Writing tiny GGUF files in llama.cpp's layout from the tiny models of
tiny_models.py: the tokenizer part every architecture's file shares."""

from __future__ import annotations

import json
import os
import zlib

# Hugging Face block pieces -> llama.cpp's, for the attention every architecture here shares (written
# from llama.cpp's names, not from shoal's own table, so the tests check that table).
ATTENTION_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def add_tiny_tokenizer(w, hf_dir: str, cfg: dict) -> None:
    """The folder's byte-level BPE tokenizer as GGUF's gpt2 vocabulary on
    GGUFWriter `w` (ids past the trained vocabulary padded, the first three
    marked as control tokens), with the config's bos and eos."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)["model"]
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    for t, i in tok["vocab"].items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def add_shape(w, c: dict) -> None:
    """The model's shape from config.json `c`, as every architecture's file has it."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


LLAMA_NAMES = {
    **ATTENTION_NAMES,
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w, n_heads: int):
    """llama.cpp's q/k row order (convert_hf_to_gguf's LlamaModel.permute): dims i and i + head_dim/2 adjacent."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_llama_gguf(hf_dir: str, path: str, types: dict[str, int] | None = None) -> str:
    """A tiny Llama folder as llama.cpp's converter writes it, each matrix in
    the ggml type `types` gives its llama.cpp name piece ("attn_q",
    "token_embd", ...; quantized by gguf's own quantizer, or for the
    K-quants, which it cannot make, random blocks), F32 otherwise."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    Q = gguf.GGMLQuantizationType
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    types = types or {}
    w = gguf.GGUFWriter(path, "llama")
    add_shape(w, c)
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    add_tiny_tokenizer(w, hf_dir, c)
    sd = {k: v.float().numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}

    def add(name: str, a) -> None:
        qtype = types.get(name.split(".")[-2])
        if qtype is None:
            w.add_tensor(name, a)
            return
        qtype = gguf.GGMLQuantizationType(qtype)
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf cannot quantize these: random blocks in their place
            from test_gguf_kquant_kernels import _blocks

            w.add_tensor(name, _blocks(a.shape[0], a.shape[1], qtype, zlib.crc32(name.encode())), raw_dtype=qtype)
            return
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        add("output.weight", sd["lm_head.weight"])
    for i in range(c["num_hidden_layers"]):
        for hf, ours in LLAMA_NAMES.items():
            if f"model.layers.{i}.{hf}.weight" not in sd:  # the QK norms of later families
                continue
            a = sd[f"model.layers.{i}.{hf}.weight"]
            if ours == "attn_q":
                a = _permute(a, c["num_attention_heads"])
            elif ours == "attn_k":
                a = _permute(a, c["num_key_value_heads"])
            add(f"blk.{i}.{ours}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
